package moe

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// handWeights builds a 4-expert layer with H=2, I=1 whose router logits for
// x = (1, 0) are exactly logits, and whose expert e outputs
// silu(1) * (e+1) * (1, -1) for that x.
func handWeights(logits []float64, bias []float32) *Weights {
	w := &Weights{Bias: bias}
	for e, l := range logits {
		w.Router = append(w.Router, float32(l), 0)
		w.Experts = append(w.Experts, Expert{Gate: []float32{1, 0}, Up: []float32{float32(e + 1), 0}, Down: []float32{1, -1}})
	}
	return w
}

func handConfig(f Family) *Config {
	return &Config{Family: f, HiddenSize: 2, NumExperts: 4, TopK: 2, Intermediate: 1, Scoring: Softmax,
		TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1, RoutedScalingFactor: 1, HiddenAct: "silu",
		MoELayerFreq: 1, DecoderSparseStep: 1}
}

func sig(v float64) float64 { return 1 / (1 + math.Exp(-v)) }

func TestRouteHandComputed(t *testing.T) {
	ln := math.Log
	// softmax of these logits is exactly (0.1, 0.2, 0.3, 0.4).
	p1234 := []float64{ln(0.1), ln(0.2), ln(0.3), ln(0.4)}
	// softmax = (0.35, 0.05, 0.3, 0.3): greedy takes 0 and 2 (tie 2/3 -> lower index),
	// group-limited with groups {0,1},{2,3} and 1 group kept takes 0 and 1.
	pGroup := []float64{ln(0.35), ln(0.05), ln(0.3), ln(0.3)}
	cases := []struct {
		name    string
		cfg     func() *Config
		logits  []float64
		bias    []float32
		wantIdx []int32
		wantW   []float64
	}{
		{"v2 greedy scaled", func() *Config { c := handConfig(DeepseekV2); c.RoutedScalingFactor = 2; return c },
			p1234, nil, []int32{3, 2}, []float64{0.8, 0.6}},
		{"v2 greedy tie lower index", func() *Config { return handConfig(DeepseekV2) },
			pGroup, nil, []int32{0, 2}, []float64{0.35, 0.3}},
		{"v2 group limited", func() *Config {
			c := handConfig(DeepseekV2)
			c.TopKMethod, c.NumGroups, c.TopKGroups = GroupLimitedGreedy, 2, 1
			return c
		}, pGroup, nil, []int32{0, 1}, []float64{0.35, 0.05}},
		{"qwen3 no norm", func() *Config { return handConfig(Qwen3MoE) }, p1234, nil, []int32{3, 2}, []float64{0.4, 0.3}},
		{"qwen3 norm", func() *Config { c := handConfig(Qwen3MoE); c.NormTopKProb = true; return c },
			p1234, nil, []int32{3, 2}, []float64{4.0 / 7, 3.0 / 7}},
		{"mixtral", func() *Config { c := handConfig(Mixtral); c.NormTopKProb = true; return c },
			p1234, nil, []int32{3, 2}, []float64{4.0 / 7, 3.0 / 7}},
		{"v3 bias selects, weights unbiased", func() *Config {
			c := handConfig(DeepseekV3)
			c.Scoring, c.TopKMethod, c.NumGroups, c.TopKGroups = Sigmoid, NoAuxTC, 2, 2
			c.NormTopKProb, c.RoutedScalingFactor = true, 2.5
			return c
		}, []float64{0, 1, 2, 3}, []float32{1, 0, 0, 0}, []int32{0, 3},
			[]float64{2.5 * sig(0) / (sig(0) + sig(3) + 1e-20), 2.5 * sig(3) / (sig(0) + sig(3) + 1e-20)}},
		{"v3 group sum of top 2", func() *Config {
			// choice = (1.5, .731, .881, .953): group {0,1} sums 2.23 > 1.83, so only it is kept.
			c := handConfig(DeepseekV3)
			c.Scoring, c.TopKMethod, c.NumGroups, c.TopKGroups = Sigmoid, NoAuxTC, 2, 1
			c.RoutedScalingFactor = 1
			return c
		}, []float64{0, 1, 2, 3}, []float32{1, 0, 0, 0}, []int32{0, 1}, []float64{sig(0), sig(1)}},
		{"v3 masked zero beats negative", func() *Config {
			// Biased choice scores are all negative: (-1.5, -1.5, -2.5, -2.5). Group
			// {0,1} is kept, group {2,3} is masked to 0.0 as transformers does, and
			// those zeros then beat the kept negative scores.
			c := handConfig(DeepseekV3)
			c.Scoring, c.TopKMethod, c.NumGroups, c.TopKGroups = Sigmoid, NoAuxTC, 2, 1
			return c
		}, []float64{0, 0, 0, 0}, []float32{-2, -2, -3, -3}, []int32{2, 3}, []float64{0.5, 0.5}},
	}
	x := []float32{1, 0}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := c.cfg()
			w := handWeights(c.logits, c.bias)
			idx, wt, err := Route(cfg, w, x, 1)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(idx, c.wantIdx) {
				t.Fatalf("idx = %v, want %v", idx, c.wantIdx)
			}
			for k := range wt {
				if math.Abs(float64(wt[k])-c.wantW[k]) > 1e-6 {
					t.Fatalf("weight = %v, want %v", wt, c.wantW)
				}
			}
			y, err := Reference(cfg, w, x, 1)
			if err != nil {
				t.Fatal(err)
			}
			var want float64
			for k, e := range c.wantIdx {
				want += c.wantW[k] * sig(1) * float64(e+1) // silu(1) = sig(1)
			}
			if math.Abs(float64(y[0])-want) > 1e-6 || math.Abs(float64(y[1])+want) > 1e-6 {
				t.Fatalf("y = %v, want (%v, %v)", y, want, -want)
			}
		})
	}
}

func TestReferenceSharedExpertHand(t *testing.T) {
	x := []float32{1, 0}
	shared := &Expert{Gate: []float32{2, 0}, Up: []float32{3, 0}, Down: []float32{1, 2}}
	sh := 2 * sig(2) * 3 // silu(2) * 3
	cases := []struct {
		name  string
		fam   Family
		gate  []float32
		scale float64
	}{
		{"deepseek shared always on", DeepseekV2, nil, 1},
		{"qwen2 sigmoid gate", Qwen2MoE, []float32{-1, 5}, sig(-1)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := handConfig(c.fam)
			cfg.SharedIntermediate, cfg.SharedGate = 1, c.gate != nil
			w := handWeights([]float64{math.Log(0.1), math.Log(0.2), math.Log(0.3), math.Log(0.4)}, nil)
			w.Shared, w.SharedGate = shared, c.gate
			y, err := Reference(cfg, w, x, 1)
			if err != nil {
				t.Fatal(err)
			}
			routed := (0.4*4 + 0.3*3) * sig(1)
			want0, want1 := routed+c.scale*sh, -routed+2*c.scale*sh
			if math.Abs(float64(y[0])-want0) > 1e-5 || math.Abs(float64(y[1])-want1) > 1e-5 {
				t.Fatalf("y = %v, want (%v, %v)", y, want0, want1)
			}
		})
	}
}

// naive is an independent, deliberately plain implementation of the same
// semantics, written the way transformers loops: repeated argmax for top-k,
// expert-major accumulation.
func naive(cfg *Config, w *Weights, x []float32, T int) (y []float64, sel [][]int, wts [][]float64) {
	H, E, I, K := cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate, cfg.TopK
	y = make([]float64, T*H)
	sel = make([][]int, T)
	wts = make([][]float64, T)
	argmaxK := func(v []float64, k int) []int {
		taken := make([]bool, len(v))
		var out []int
		for j := 0; j < k; j++ {
			best := -1
			for i := range v {
				if !taken[i] && (best < 0 || v[i] > v[best]) {
					best = i
				}
			}
			taken[best] = true
			out = append(out, best)
		}
		return out
	}
	for t := 0; t < T; t++ {
		xt := x[t*H : (t+1)*H]
		logit := make([]float64, E)
		for e := 0; e < E; e++ {
			for h := 0; h < H; h++ {
				logit[e] += float64(w.Router[e*H+h]) * float64(xt[h])
			}
		}
		score := make([]float64, E)
		if cfg.Scoring == Sigmoid {
			for e := range score {
				score[e] = sig(logit[e])
			}
		} else {
			var z float64
			for e := range score {
				score[e] = math.Exp(logit[e])
				z += score[e]
			}
			for e := range score {
				score[e] /= z
			}
		}
		choice := slices.Clone(score)
		for e := range choice {
			if w.Bias != nil {
				choice[e] += float64(w.Bias[e])
			}
		}
		if cfg.NumGroups > 1 {
			per := E / cfg.NumGroups
			gs := make([]float64, cfg.NumGroups)
			for g := range gs {
				top := argmaxK(choice[g*per:(g+1)*per], min(2, per))
				if cfg.TopKMethod == NoAuxTC {
					gs[g] = choice[g*per+top[0]] + choice[g*per+top[1]]
				} else {
					gs[g] = choice[g*per+top[0]]
				}
			}
			keep := argmaxK(gs, cfg.TopKGroups)
			for e := range choice {
				if !slices.Contains(keep, e/per) {
					choice[e] = 0
				}
			}
		}
		idx := argmaxK(choice, K)
		wt := make([]float64, K)
		var sum float64
		for k, e := range idx {
			if cfg.Family == DeepseekV3 {
				wt[k] = score[e]
			} else {
				wt[k] = choice[e]
			}
			sum += wt[k]
		}
		for k := range wt {
			if cfg.NormTopKProb {
				if cfg.Family == DeepseekV3 {
					wt[k] /= sum + 1e-20
				} else {
					wt[k] /= sum
				}
			}
			if cfg.Family == DeepseekV2 || cfg.Family == DeepseekV3 {
				wt[k] *= cfg.RoutedScalingFactor
			}
		}
		sel[t], wts[t] = idx, wt
	}
	mlp := func(ex *Expert, xt []float32, I int) []float64 {
		out := make([]float64, H)
		for i := 0; i < I; i++ {
			var g, u float64
			for h := 0; h < H; h++ {
				g += float64(ex.Gate[i*H+h]) * float64(xt[h])
				u += float64(ex.Up[i*H+h]) * float64(xt[h])
			}
			a := g * sig(g) * u
			for h := 0; h < H; h++ {
				out[h] += float64(ex.Down[h*I+i]) * a
			}
		}
		return out
	}
	for e := 0; e < E; e++ { // expert-major, like the transformers loop
		for t := 0; t < T; t++ {
			if k := slices.Index(sel[t], e); k >= 0 {
				o := mlp(&w.Experts[e], x[t*H:(t+1)*H], I)
				for h := range o {
					y[t*H+h] += wts[t][k] * o[h]
				}
			}
		}
	}
	if w.Shared != nil {
		for t := 0; t < T; t++ {
			xt := x[t*H : (t+1)*H]
			o := mlp(w.Shared, xt, cfg.SharedIntermediate)
			s := 1.0
			if w.SharedGate != nil {
				var d float64
				for h := range xt {
					d += float64(w.SharedGate[h]) * float64(xt[h])
				}
				s = sig(d)
			}
			for h := range o {
				y[t*H+h] += s * o[h]
			}
		}
	}
	return y, sel, wts
}

func TestReferenceMatchesNaive(t *testing.T) {
	for name, cfg := range variants() {
		for _, T := range []int{1, 7, 33} {
			t.Run(fmt.Sprintf("%s/T%d", name, T), func(t *testing.T) {
				w, err := RandomWeights(cfg, 11)
				if err != nil {
					t.Fatal(err)
				}
				if w.Bias != nil { // make the bias matter for selection
					for e := range w.Bias {
						w.Bias[e] *= 4
					}
				}
				r := rand.New(rand.NewPCG(5, uint64(T)))
				x := make([]float32, T*cfg.HiddenSize)
				for i := range x {
					x[i] = float32(r.NormFloat64() * 2)
				}
				y, err := Reference(cfg, w, x, T)
				if err != nil {
					t.Fatal(err)
				}
				ny, nsel, nw := naive(cfg, w, x, T)
				var maxRef, maxDiff float64
				for i := range y {
					maxRef = max(maxRef, math.Abs(ny[i]))
					maxDiff = max(maxDiff, math.Abs(float64(y[i])-ny[i]))
				}
				if maxDiff > 1e-6*maxRef {
					t.Fatalf("max |y - naive| = %g, max |naive| = %g", maxDiff, maxRef)
				}
				idx, wt, err := Route(cfg, w, x, T)
				if err != nil {
					t.Fatal(err)
				}
				K := cfg.TopK
				for tk := 0; tk < T; tk++ {
					for k := 0; k < K; k++ {
						if int(idx[tk*K+k]) != nsel[tk][k] || math.Abs(float64(wt[tk*K+k])-nw[tk][k]) > 1e-6 {
							t.Fatalf("token %d: Route %v %v, naive %v %v", tk, idx[tk*K:(tk+1)*K], wt[tk*K:(tk+1)*K], nsel[tk], nw[tk])
						}
					}
				}
			})
		}
	}
}

func TestRouteProperties(t *testing.T) {
	for name, cfg := range variants() {
		t.Run(name, func(t *testing.T) {
			w, _ := RandomWeights(cfg, 3)
			T := 16
			r := rand.New(rand.NewPCG(9, 9))
			x := make([]float32, T*cfg.HiddenSize)
			for i := range x {
				x[i] = float32(r.NormFloat64())
			}
			idx, wt, err := Route(cfg, w, x, T)
			if err != nil {
				t.Fatal(err)
			}
			K := cfg.TopK
			for tk := 0; tk < T; tk++ {
				seen := map[int32]bool{}
				var sum float64
				for k := 0; k < K; k++ {
					e := idx[tk*K+k]
					if e < 0 || int(e) >= cfg.NumExperts || seen[e] {
						t.Fatalf("token %d: bad or repeated expert %d in %v", tk, e, idx[tk*K:(tk+1)*K])
					}
					seen[e] = true
					if wt[tk*K+k] < 0 {
						t.Fatalf("negative weight %v", wt[tk*K+k])
					}
					sum += float64(wt[tk*K+k])
				}
				if cfg.NormTopKProb {
					want := 1.0
					if cfg.Family == DeepseekV3 {
						want = cfg.RoutedScalingFactor
					}
					if math.Abs(sum-want) > 1e-5 {
						t.Fatalf("token %d: weights sum to %v, want %v", tk, sum, want)
					}
				}
				if cfg.NumGroups > 1 {
					groups := map[int]bool{}
					for k := 0; k < K; k++ {
						groups[int(idx[tk*K+k])/(cfg.NumExperts/cfg.NumGroups)] = true
					}
					if len(groups) > cfg.TopKGroups {
						t.Fatalf("token %d: experts %v span %d groups, topk_group = %d", tk, idx[tk*K:(tk+1)*K], len(groups), cfg.TopKGroups)
					}
				}
			}
		})
	}
}

func TestReferenceErrors(t *testing.T) {
	cfg := variants()["qwen3_moe"]
	w, _ := RandomWeights(cfg, 1)
	cases := []struct {
		name string
		x    []float32
		T    int
		w    *Weights
		want string
	}{
		{"short x", make([]float32, 15), 1, w, "x has 15 values, want T*H = 1*16 = 16"},
		{"negative T", nil, -1, w, "T = -1"},
		{"bad weights", make([]float32, 16), 1, &Weights{}, "router has 0 values"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Reference(cfg, c.w, c.x, c.T)
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "moe.Reference") {
				t.Fatalf("Reference err = %v, want %q", err, c.want)
			}
			_, _, err = Route(cfg, c.w, c.x, c.T)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Route err = %v, want %q", err, c.want)
			}
		})
	}
	y, err := Reference(cfg, w, nil, 0)
	if err != nil || len(y) != 0 {
		t.Fatalf("T=0: %v, %v", y, err)
	}
}

func BenchmarkReferenceDeepseekV2Lite(b *testing.B) {
	cfg := DeepseekV2Lite()
	cfg.NumExperts = 16 // keep host memory small; routing cost is per selected expert
	w, err := RandomWeights(cfg, 1)
	if err != nil {
		b.Fatal(err)
	}
	x := make([]float32, cfg.HiddenSize)
	for i := range x {
		x[i] = float32(i%7) / 7
	}
	for b.Loop() {
		if _, err := Reference(cfg, w, x, 1); err != nil {
			b.Fatal(err)
		}
	}
}
