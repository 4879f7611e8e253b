package moe

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"

	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// InitDist is the distribution RandomWeightsDist draws a layer's weights from.
type InitDist int

const (
	// InitUniform is RandomWeights' distribution: every weight uniform in
	// [-1/sqrt(fan_in), 1/sqrt(fan_in)] (nn.Linear's default bound), the
	// correction bias (noaux_tc) uniform in [-0.05, 0.05].
	InitUniform InitDist = iota
	// InitNormal draws every weight and the correction bias from N(0, 0.02²),
	// as the Triton peer (bench/peers/triton_fused_moe.py, after vLLM's
	// benchmarks) does. For sigmoid + bias routing (DeepSeek-V3) the
	// distribution decides how many experts a batch touches, so a comparison
	// with the peer draws from the same one.
	InitNormal
)

// InitNormalStd is InitNormal's standard deviation.
const InitNormalStd = 0.02

// ParseInitDist parses "uniform" or "normal".
func ParseInitDist(s string) (InitDist, error) {
	switch s {
	case "uniform":
		return InitUniform, nil
	case "normal":
		return InitNormal, nil
	}
	return 0, fmt.Errorf("moe.ParseInitDist: %q is not a distribution (uniform or normal)", s)
}

func (d InitDist) String() string {
	switch d {
	case InitUniform:
		return "uniform"
	case InitNormal:
		return "normal"
	}
	return fmt.Sprintf("InitDist(%d)", int(d))
}

// Describe says what d draws, for reports: "U(±1/sqrt(fan_in)), bias
// U(±0.05)" or "N(0, 0.02²), bias N(0, 0.02²)".
func (d InitDist) Describe() string {
	if d == InitNormal {
		return fmt.Sprintf("N(0, %g²) for every weight and the bias", InitNormalStd)
	}
	return "U(±1/sqrt(fan_in)), bias U(±0.05)"
}

// RandomWeightsDist returns weights for cfg drawn from d; InitUniform gives
// exactly RandomWeights(cfg, seed). The same cfg, seed and d always give the
// same weights, whatever GOMAXPROCS is (each tensor has its own PCG stream,
// the streams RandomWeights uses). Nothing runs on a device.
func RandomWeightsDist(cfg *Config, seed uint64, d InitDist) (*Weights, error) {
	switch d {
	case InitUniform:
		return RandomWeights(cfg, seed)
	case InitNormal:
	default:
		return nil, fmt.Errorf("moe.RandomWeightsDist: unknown distribution %d", int(d))
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("moe.RandomWeightsDist: %w", err)
	}
	H, E, I := cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate
	fill := func(stream uint64, n int) []float32 {
		r := rand.New(rand.NewPCG(seed, stream))
		out := make([]float32, n)
		for i := range out {
			out[i] = float32(r.NormFloat64() * InitNormalStd)
		}
		return out
	}
	w := &Weights{DType: safetensors.F32, Experts: make([]Expert, E)}
	w.Router = fill(1, E*H)
	if cfg.HasBias() {
		w.Bias = fill(2, E)
	}
	if cfg.SharedGate {
		w.SharedGate = fill(3, H)
	}
	if S := cfg.SharedIntermediate; S > 0 {
		w.Shared = &Expert{Gate: fill(4, S*H), Up: fill(5, S*H), Down: fill(6, H*S)}
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for e := range E {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			base := uint64(16 + 3*e)
			w.Experts[e] = Expert{Gate: fill(base, I*H), Up: fill(base+1, I*H), Down: fill(base+2, H*I)}
		}()
	}
	wg.Wait()
	return w, nil
}
