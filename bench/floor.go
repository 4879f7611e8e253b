package bench

import "github.com/gpuctx/gpuctx/moe"

// BatchFLOPs is the arithmetic of one forward of T tokens through the layer c:
// 2·T·H·E (router) + 2·T·K·3·H·I (routed) + 2·T·3·H·Is (shared).
func BatchFLOPs(c *moe.Config, T int) float64 {
	t, H, E, K, I, S := float64(T), float64(c.HiddenSize), float64(c.NumExperts), float64(c.TopK), float64(c.Intermediate), float64(c.SharedIntermediate)
	return 2*t*H*E + 2*t*K*3*H*I + 2*t*3*H*S
}

// Floor is the floor model of one forward: the larger of the time to read the
// weights it touches at the copy bandwidth and the time of its FLOPs at the
// GEMM rate.
type Floor struct {
	BytesUS, ComputeUS, US float64
	Bound                  string // "bytes" or "compute"
}

// NewFloor returns the floor of a forward touching weightBytes and doing
// flops, with the ceilings copyBW (bytes read + written per second) and
// gemmRate (FLOP/s).
func NewFloor(weightBytes int64, flops, copyBW, gemmRate float64) Floor {
	f := Floor{BytesUS: float64(weightBytes) / copyBW * 1e6, ComputeUS: flops / gemmRate * 1e6}
	f.US, f.Bound = f.BytesUS, "bytes"
	if f.ComputeUS > f.BytesUS {
		f.US, f.Bound = f.ComputeUS, "compute"
	}
	return f
}
