package moe

import (
	"fmt"
	"math"
	"runtime"
	"sort"

	"golang.org/x/sync/errgroup"
)

// Route computes the expert selection of the router for T tokens x [T][H]:
// idx[t*K+k] is the k-th expert chosen for token t and weight[t*K+k] its routing
// weight (after renormalisation and routed_scaling_factor), exactly as the
// family's transformers MoE block computes them, but in float64 arithmetic:
//
//   - deepseek_v2: softmax over E; greedy top-K, or group_limited_greedy (group
//     score = max in group, keep topk_group groups, others' scores set to 0.0);
//     weights = the (masked) scores; no renormalisation (transformers ignores
//     norm_topk_prob); times routed_scaling_factor.
//   - deepseek_v3: sigmoid; choice scores = scores + e_score_correction_bias;
//     group score = sum of the top 2 choice scores in the group; keep topk_group
//     groups, others' choice scores set to 0.0; top-K of the choice scores;
//     weights = the unbiased sigmoid scores; if norm_topk_prob divide by
//     (sum + 1e-20); times routed_scaling_factor.
//   - qwen2_moe, qwen3_moe: softmax over E, top-K, renormalise (no epsilon) only
//     if norm_topk_prob. mixtral: the same, always renormalised.
//
// Within a token the K experts are ordered by decreasing selection score; equal
// scores are broken by the lower expert index first. torch.topk gives no order
// guarantee (sorted=False) and no tie rule, so compare selections as sets per
// token, and expect exact ties only in contrived inputs.
//
// Route runs on the calling goroutine (it may fan out over GOMAXPROCS worker
// goroutines for large T) and touches no device; it is safe to call concurrently.
func Route(cfg *Config, w *Weights, x []float32, T int) (idx []int32, weight []float32, err error) {
	if err := checkInputs("moe.Route", cfg, w, x, T); err != nil {
		return nil, nil, err
	}
	K := cfg.TopK
	idx = make([]int32, T*K)
	weight = make([]float32, T*K)
	parallelTokens(T, func(t int) {
		r := routeToken(cfg, w, x[t*cfg.HiddenSize:(t+1)*cfg.HiddenSize])
		for k := 0; k < K; k++ {
			idx[t*K+k] = int32(r.idx[k])
			weight[t*K+k] = float32(r.w[k])
		}
	})
	return idx, weight, nil
}

// Reference computes the MoE block's output y [T][H] for x [T][H] in float64
// arithmetic, with the semantics of the family's transformers MoE block: the
// routing of Route, then y = sum_k weight_k * Down_e(silu(Gate_e x) * Up_e x) plus
// the shared expert (times sigmoid(shared_expert_gate . x) for Qwen2-MoE). The
// residual connection is not included (the block does not add it either). The
// result is rounded to float32 once at the end.
//
// Reference runs on the calling goroutine (fanning out over GOMAXPROCS worker
// goroutines for large T), touches no device, and is safe to call concurrently.
func Reference(cfg *Config, w *Weights, x []float32, T int) ([]float32, error) {
	if err := checkInputs("moe.Reference", cfg, w, x, T); err != nil {
		return nil, err
	}
	H := cfg.HiddenSize
	y := make([]float32, T*H)
	parallelTokens(T, func(t int) {
		xt := x[t*H : (t+1)*H]
		acc := make([]float64, H)
		r := routeToken(cfg, w, xt)
		for k, e := range r.idx {
			expertInto(acc, &w.Experts[e], xt, cfg.Intermediate, r.w[k])
		}
		if w.Shared != nil {
			scale := 1.0
			if w.SharedGate != nil {
				scale = sigmoid(dot(w.SharedGate, xt))
			}
			expertInto(acc, w.Shared, xt, cfg.SharedIntermediate, scale)
		}
		for h, v := range acc {
			y[t*H+h] = float32(v)
		}
	})
	return y, nil
}

func checkInputs(call string, cfg *Config, w *Weights, x []float32, T int) error {
	if err := w.Check(cfg); err != nil {
		return fmt.Errorf("%s: %w", call, err)
	}
	if T < 0 {
		return fmt.Errorf("%s: T = %d tokens: must be >= 0", call, T)
	}
	if len(x) != T*cfg.HiddenSize {
		return fmt.Errorf("%s: x has %d values, want T*H = %d*%d = %d", call, len(x), T, cfg.HiddenSize, T*cfg.HiddenSize)
	}
	return nil
}

// parallelTokens calls f(t) for t in [0,T), spread over up to GOMAXPROCS
// goroutines. Each t writes disjoint output, so no locking is needed.
func parallelTokens(T int, f func(t int)) {
	workers := min(runtime.GOMAXPROCS(0), T)
	if workers <= 1 {
		for t := 0; t < T; t++ {
			f(t)
		}
		return
	}
	var g errgroup.Group
	next := make(chan int, T)
	for t := 0; t < T; t++ {
		next <- t
	}
	close(next)
	for range workers {
		g.Go(func() error {
			for t := range next {
				f(t)
			}
			return nil
		})
	}
	_ = g.Wait() // f reports no errors
}

func dot(a, x []float32) float64 {
	var s float64
	for i, v := range a {
		s += float64(v) * float64(x[i])
	}
	return s
}

func sigmoid(v float64) float64 { return 1 / (1 + math.Exp(-v)) }

func silu(v float64) float64 { return v / (1 + math.Exp(-v)) }

// expertInto adds scale * Down(silu(Gate x) * Up x) to acc.
func expertInto(acc []float64, ex *Expert, x []float32, I int, scale float64) {
	H := len(x)
	a := make([]float64, I)
	for i := 0; i < I; i++ {
		a[i] = silu(dot(ex.Gate[i*H:(i+1)*H], x)) * dot(ex.Up[i*H:(i+1)*H], x)
	}
	for h := 0; h < H; h++ {
		row := ex.Down[h*I : (h+1)*I]
		var s float64
		for i, v := range row {
			s += float64(v) * a[i]
		}
		acc[h] += scale * s
	}
}

type routed struct {
	idx []int
	w   []float64
}

// topIndices returns the k indices of the largest vals, largest first, ties to
// the lower index.
func topIndices(vals []float64, k int) []int {
	order := make([]int, len(vals))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return vals[order[a]] > vals[order[b]] })
	return order[:k]
}

// routeToken routes token x as transformers does: its scores, the choice
// values (scores plus the correction bias), the groups kept, the top K and
// their weights.
func routeToken(cfg *Config, w *Weights, x []float32) routed {
	E, H, K := cfg.NumExperts, cfg.HiddenSize, cfg.TopK
	scores := make([]float64, E)
	for e := 0; e < E; e++ {
		scores[e] = dot(w.Router[e*H:(e+1)*H], x)
	}
	refScores(cfg.Scoring, scores)
	choice := append([]float64(nil), scores...)
	if w.Bias != nil {
		for e := range choice {
			choice[e] += float64(w.Bias[e])
		}
	}
	if cfg.TopKMethod == GroupLimitedGreedy || cfg.TopKMethod == NoAuxTC {
		refMaskGroups(cfg, choice)
	}
	r := routed{idx: topIndices(choice, K), w: make([]float64, K)}
	for k, e := range r.idx {
		switch cfg.TopKMethod {
		case NoAuxTC:
			r.w[k] = scores[e] // unbiased score
		default:
			r.w[k] = choice[e] // the (masked) score torch.topk returned
		}
	}
	refNormalise(cfg, r.w)
	return r
}

// refScores replaces the router logits v by their sigmoids, or by their
// softmax.
func refScores(scoring Scoring, v []float64) {
	if scoring == Sigmoid {
		for e, x := range v {
			v[e] = sigmoid(x)
		}
		return
	}
	m := math.Inf(-1)
	for _, x := range v {
		m = max(m, x)
	}
	var s float64
	for e, x := range v {
		v[e] = math.Exp(x - m)
		s += v[e]
	}
	for e := range v {
		v[e] /= s
	}
}

// refMaskGroups scores cfg.NumGroups groups of choice (group_limited_greedy: the
// max, noaux_tc: the sum of the top 2), keeps the cfg.TopKGroups best and
// zeroes the choices of the other groups.
func refMaskGroups(cfg *Config, choice []float64) {
	G := cfg.NumGroups
	per := len(choice) / G
	gs := make([]float64, G)
	for g := 0; g < G; g++ {
		grp := choice[g*per : (g+1)*per]
		if cfg.TopKMethod == GroupLimitedGreedy {
			gs[g] = math.Inf(-1)
			for _, v := range grp {
				gs[g] = max(gs[g], v)
			}
		} else {
			top := topIndices(grp, 2)
			gs[g] = grp[top[0]] + grp[top[1]]
		}
	}
	keep := make([]bool, G)
	for _, g := range topIndices(gs, cfg.TopKGroups) {
		keep[g] = true
	}
	for e := range choice {
		if !keep[e/per] {
			choice[e] = 0 // masked_fill(~mask, 0.0), as transformers does
		}
	}
}

// refNormalise renormalises the top-K weights w when cfg.NormTopKProb
// (DeepSeek-V3 adds 1e-20 to the sum) and scales DeepSeek's by
// cfg.RoutedScalingFactor.
func refNormalise(cfg *Config, w []float64) {
	if cfg.NormTopKProb {
		var s float64
		for _, v := range w {
			s += v
		}
		if cfg.Family == DeepseekV3 {
			s += 1e-20
		}
		for k := range w {
			w[k] /= s
		}
	}
	if cfg.Family == DeepseekV2 || cfg.Family == DeepseekV3 {
		for k := range w {
			w[k] *= cfg.RoutedScalingFactor
		}
	}
}
