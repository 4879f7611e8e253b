package moe

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// routerStage is the router: its weights ([E,H] in the layer's dtype, the
// f32 correction bias, zeros when the config has none), gpuctx_moe_route, and
// its outputs: the f32 logits [T,E], and per token ks slots of expert indices
// (idx) and routing weights (wts), the fused shared expert's slots after the
// K routed ones. On the one-launch path the dispatch stage fills them.
type routerStage struct {
	e            *env
	weight, bias *gpuctx.Buffer
	kRoute       moekernels.Launcher[moekernels.Route]
	logits       *gpuctx.Buffer
	idx, wts     *gpuctx.Buffer
}

// needs returns the router's scratch for T tokens of ks slots.
func (r *routerStage) needs(T, ks int) []need {
	return []need{{&r.logits, 4 * T * r.e.cfg.NumExperts}, {&r.idx, 4 * T * ks}, {&r.wts, 4 * T * ks}}
}

// route queues the router GEMM (through the main stream's Context) and
// gpuctx_moe_route over T tokens of x on the main stream, with ks slots per
// token (ks-K of them the fused shared expert's). early launches the route
// kernel with LaunchEarly (a Layer), else with Launch (an ExpertShard).
// It waits for nothing but the work queued on the main stream.
func (r *routerStage) route(x *gpuctx.Buffer, T, ks int, early bool) error {
	e := r.e
	c := &e.cfg
	H, E, K := c.HiddenSize, c.NumExperts, c.TopK
	err := e.ctx.BlasFlavour(e.flav, func(h gpuctx.Blas) error {
		return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: E, K: H, Alpha: 1,
			A: x, B: r.weight, C: r.logits, AB: e.dt, CType: gpuctx.F32})
	})
	if err != nil {
		return fmt.Errorf("moe: router GEMM: %w", err)
	}
	launch := r.kRoute.Launch
	if early {
		launch = r.kRoute.LaunchEarly
	}
	return launch(e.main, gpuctx.Dim3{X: gridFor(T), Y: 1, Z: 1}, gpuctx.Dim3{X: 32, Y: 1, Z: 1}, 0, moekernels.Route{
		Logits: r.logits, Bias: r.bias, TopkIdx: r.idx, TopkW: r.wts, T: int32(T), E: int32(E), K: int32(K),
		Rule: routeRule(c), Ks: int32(ks), Ns: int32(ks - K)})
}

// routeRule returns how gpuctx_moe_route and gpuctx_moe_route_align route
// for config c.
func routeRule(c *Config) moekernels.RouteRule {
	scoring, method, eps, scale := moekernels.ScoreSoftmax, moekernels.MethodGreedy, float32(0), float32(1)
	if c.Scoring == Sigmoid {
		scoring = moekernels.ScoreSigmoid
	}
	switch c.TopKMethod {
	case GroupLimitedGreedy:
		method = moekernels.MethodGroupMax
	case NoAuxTC:
		method = moekernels.MethodGroupTop2
	}
	if c.Family == DeepseekV3 {
		eps = 1e-20
	}
	if c.Family == DeepseekV2 || c.Family == DeepseekV3 {
		scale = float32(c.RoutedScalingFactor)
	}
	return moekernels.RouteRule{Scoring: scoring, Method: method, Groups: int32(c.NumGroups), TopkGroups: int32(c.TopKGroups),
		HasBias: flag(c.HasBias()), Norm: flag(c.NormTopKProb), NormEps: eps, Scale: scale}
}
