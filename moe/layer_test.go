package moe

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// testBackend is one device the Layer tests run on, with the f32 tolerance of
// that backend (CUDA: cuBLAS's summation order, TF32 off).
type testBackend struct {
	name  string
	dev   *gpuctx.Device
	tolF2 float64
}

// layerBackends returns the CPU backend, and CUDA when it opens. Runtimes are
// closed when the test ends.
func layerBackends(t *testing.T) []testBackend {
	t.Helper()
	var out []testBackend
	for _, b := range []struct {
		name string
		tol  float64
	}{{"cpu", 1e-5}, {"cuda", 1e-4}} {
		rt, err := gpuctx.OpenBackend(b.name)
		if err != nil {
			t.Logf("backend %s not available, not tested: %v", b.name, firstLine(err))
			continue
		}
		t.Cleanup(func() { _ = rt.Close() })
		dev, err := rt.Device(0)
		if err != nil {
			t.Fatalf("%s: Device(0): %v", b.name, err)
		}
		t.Logf("testing on backend %s (%s)", b.name, dev.Info().Name)
		out = append(out, testBackend{b.name, dev, b.tol})
	}
	if len(out) == 0 {
		t.Fatal("no backend opened, not even cpu")
	}
	return out
}

func firstLine(err error) string {
	s := err.Error()
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

var layerDTypes = []gpuctx.DType{gpuctx.F32, gpuctx.BF16}

func tolFor(b testBackend, dt gpuctx.DType) float64 {
	if dt == gpuctx.BF16 {
		return 2e-2
	}
	return b.tolF2
}

// relErr is max|got-want| / max|want|.
func relErr(got, want []float32) float64 {
	var maxRef, maxDiff float64
	for i := range want {
		maxRef = max(maxRef, math.Abs(float64(want[i])))
		maxDiff = max(maxDiff, math.Abs(float64(got[i])-float64(want[i])))
	}
	if maxRef == 0 {
		return maxDiff
	}
	return maxDiff / maxRef
}

func randomX(T, H int, seed uint64) []float32 {
	r := rand.New(rand.NewPCG(seed, 99))
	x := make([]float32, T*H)
	for i := range x {
		x[i] = float32(4*r.Float64() - 2)
	}
	return x
}

// checkRouting compares the layer's last routing with Route: the same expert
// set per token and the same weights (to f32 rounding).
func checkRouting(t *testing.T, l *Layer, cfg *Config, w *Weights, x []float32, T int) {
	t.Helper()
	gotIdx, gotW, err := l.LastRouting()
	if err != nil {
		t.Fatal(err)
	}
	wantIdx, wantW, err := Route(cfg, w, x, T)
	if err != nil {
		t.Fatal(err)
	}
	K := cfg.TopK
	for tk := 0; tk < T; tk++ {
		want := map[int32]float32{}
		for k := 0; k < K; k++ {
			want[wantIdx[tk*K+k]] = wantW[tk*K+k]
		}
		for k := 0; k < K; k++ {
			ww, ok := want[gotIdx[tk*K+k]]
			if !ok {
				t.Fatalf("token %d: layer chose experts %v, Route %v", tk, gotIdx[tk*K:(tk+1)*K], wantIdx[tk*K:(tk+1)*K])
			}
			if d := math.Abs(float64(ww) - float64(gotW[tk*K+k])); d > 1e-5*math.Max(1, math.Abs(float64(ww))) {
				t.Fatalf("token %d expert %d: layer weight %v, Route %v", tk, gotIdx[tk*K+k], gotW[tk*K+k], ww)
			}
		}
	}
}

// TestLayerFixtures runs every transformers fixture through Layer.Forward on
// every backend, in f32 and bf16, in Single and Dual mode, and checks the f32
// routing against Route.
func TestLayerFixtures(t *testing.T) {
	dirs := fixtureDirs(t)
	for _, b := range layerBackends(t) {
		for _, dir := range dirs {
			cfg, w, cases := loadLayerFixture(t, dir)
			for _, dt := range layerDTypes {
				for _, mp := range modePaths() {
					mode, path := mp.mode, mp.path
					t.Run(b.name+"/"+filepath.Base(dir)+"/"+dt.String()+"/"+mode.String()+"/"+path.name, func(t *testing.T) {
						l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt, Mode: mode, SmallBatchTokens: path.small, NoFused: path.noFused})
						if err != nil {
							t.Fatal(err)
						}
						defer l.Close()
						for _, c := range cases {
							got, err := l.Forward(c.x, c.T)
							if err != nil {
								t.Fatal(err)
							}
							if dt == gpuctx.F32 {
								checkClose(t, c.name, got, c.y, nil, tolFor(b, dt))
								checkRouting(t, l, cfg, w, c.x, c.T)
								continue
							}
							// bf16: the layer computes with bf16-rounded x and
							// weights, so compare with the reference on those inputs;
							// against transformers' f32 output only on tokens whose
							// expert choice the rounding did not change.
							wr, xr := roundWeights(w), roundAll(c.x)
							ref, err := Reference(cfg, wr, xr, c.T)
							if err != nil {
								t.Fatal(err)
							}
							checkClose(t, c.name+" vs reference on bf16 inputs", got, ref, nil, 2e-2)
							checkRouting(t, l, cfg, wr, xr, c.T)
							same := sameRouting(t, cfg, w, c.x, wr, xr, c.T)
							checkClose(t, c.name+" vs transformers", got, c.y, same, 2e-2)
						}
					})
				}
			}
		}
	}
}

// checkClose fails the test when the relative error of got against want (over
// the tokens with rows[t] true, or all tokens when rows is nil) exceeds tol.
func checkClose(t *testing.T, what string, got, want []float32, rows []bool, tol float64) {
	t.Helper()
	if rows != nil {
		H := len(want) / len(rows)
		var g, w []float32
		skipped := 0
		for tk, ok := range rows {
			if !ok {
				skipped++
				continue
			}
			g = append(g, got[tk*H:(tk+1)*H]...)
			w = append(w, want[tk*H:(tk+1)*H]...)
		}
		if skipped > 0 {
			t.Logf("%s: %d of %d tokens left out: rounding x to bf16 changed their experts", what, skipped, len(rows))
		}
		got, want = g, w
	}
	if rel := relErr(got, want); !(rel <= tol) {
		t.Errorf("%s: relative error %.3g > %.3g", what, rel, tol)
	} else {
		t.Logf("%s: relative error %.3g", what, rel)
	}
}

// sameRouting reports per token whether Route picks the same experts for
// (w, x) and (wr, xr).
func sameRouting(t *testing.T, cfg *Config, w *Weights, x []float32, wr *Weights, xr []float32, T int) []bool {
	t.Helper()
	a, _, err := Route(cfg, w, x, T)
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := Route(cfg, wr, xr, T)
	if err != nil {
		t.Fatal(err)
	}
	K := cfg.TopK
	out := make([]bool, T)
	for tk := range out {
		set := map[int32]bool{}
		for _, e := range a[tk*K : (tk+1)*K] {
			set[e] = true
		}
		out[tk] = true
		for _, e := range b[tk*K : (tk+1)*K] {
			out[tk] = out[tk] && set[e]
		}
	}
	return out
}

// roundAll rounds v to bf16 values.
func roundAll(v []float32) []float32 {
	if v == nil {
		return nil
	}
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = half.FromBF16(half.BF16(x))
	}
	return out
}

// roundWeights returns w with every matrix the layer stores in bf16 rounded
// to bf16 (the correction bias stays f32, as on the device).
func roundWeights(w *Weights) *Weights {
	r := *w
	r.Router = roundAll(w.Router)
	r.Experts = make([]Expert, len(w.Experts))
	for i, e := range w.Experts {
		r.Experts[i] = Expert{Gate: roundAll(e.Gate), Up: roundAll(e.Up), Down: roundAll(e.Down)}
	}
	if w.Shared != nil {
		r.Shared = &Expert{Gate: roundAll(w.Shared.Gate), Up: roundAll(w.Shared.Up), Down: roundAll(w.Shared.Down)}
	}
	r.SharedGate = roundAll(w.SharedGate)
	return &r
}

// scaledPresets are random-weight layers shaped like the real models, scaled down.
func scaledPresets() map[string]*Config {
	v2 := DeepseekV2Lite()
	v2.HiddenSize, v2.NumExperts, v2.TopK, v2.Intermediate, v2.SharedIntermediate = 256, 16, 4, 64, 128
	v2g := *v2
	v2g.TopKMethod, v2g.NumGroups, v2g.TopKGroups, v2g.RoutedScalingFactor = GroupLimitedGreedy, 4, 2, 1.5
	v3 := DeepseekV3Preset()
	v3.HiddenSize, v3.NumExperts, v3.TopK, v3.Intermediate, v3.SharedIntermediate = 128, 32, 6, 32, 32
	q15 := Qwen15MoE()
	q15.HiddenSize, q15.NumExperts, q15.TopK, q15.Intermediate, q15.SharedIntermediate = 128, 12, 4, 32, 96
	q3 := Qwen3_30B_A3B()
	q3.HiddenSize, q3.NumExperts, q3.TopK, q3.Intermediate = 128, 32, 8, 48
	return map[string]*Config{"deepseek-v2-lite": v2, "deepseek-v2-group": &v2g, "deepseek-v3": v3,
		"qwen1.5-moe": q15, "qwen3-30b-a3b": q3}
}

// TestLayerRandomPresets compares Forward with Reference on scaled-down
// presets with random weights, and the routing with Route.
func TestLayerRandomPresets(t *testing.T) {
	parallelHeavy(t)
	for _, b := range layerBackends(t) {
		for name, cfg := range scaledPresets() {
			w, err := RandomWeights(cfg, 11)
			if err != nil {
				t.Fatal(err)
			}
			const T = 37
			x := randomX(T, cfg.HiddenSize, 3)
			want, err := Reference(cfg, w, x, T)
			if err != nil {
				t.Fatal(err)
			}
			for _, dt := range layerDTypes {
				for _, path := range layerPaths {
					t.Run(b.name+"/"+name+"/"+dt.String()+"/"+path.name, func(t *testing.T) {
						l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt, Mode: Auto, AutoThreshold: 8, SmallBatchTokens: path.small, NoFused: path.noFused})
						if err != nil {
							t.Fatal(err)
						}
						defer l.Close()
						got, err := l.Forward(x, T)
						if err != nil {
							t.Fatal(err)
						}
						if dt == gpuctx.F32 {
							checkClose(t, "vs reference", got, want, nil, tolFor(b, dt))
							checkRouting(t, l, cfg, w, x, T)
							return
						}
						wr, xr := roundWeights(w), roundAll(x)
						ref, err := Reference(cfg, wr, xr, T)
						if err != nil {
							t.Fatal(err)
						}
						checkClose(t, "vs reference on bf16 inputs", got, ref, nil, 2e-2)
						checkRouting(t, l, cfg, wr, xr, T)
					})
				}
			}
		}
	}
}

// deviceRun uploads x, queues ForwardDevice with mode and part, and returns
// y's raw bytes.
func deviceRun(t *testing.T, l *Layer, x []float32, T int, mode Mode, part Part) []byte {
	t.Helper()
	n := T * l.cfg.HiddenSize * l.es
	dev := l.dev
	xb, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer xb.Free()
	yb, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer yb.Free()
	if err := xb.CopyFromHost(l.encode(x)); err != nil {
		t.Fatal(err)
	}
	if err := l.MainStream().Memset(yb, 0xff); err != nil { // NaNs: a kernel that skips y is caught
		t.Fatal(err)
	}
	if err := l.ForwardDevice(xb, yb, T, mode, part); err != nil {
		t.Fatalf("ForwardDevice(T=%d, %v, %v): %v", T, mode, part, err)
	}
	if err := l.MainStream().Synchronize(); err != nil {
		t.Fatal(err)
	}
	out := make([]byte, n)
	if err := yb.CopyToHost(out); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestLayerDualBitwise checks that Dual, Auto and repeated Single runs give
// bitwise the same y as Single, for every family, on every backend, in f32
// and bf16, with T = 1, an odd T and a larger T; and that the parts add up.
func TestLayerDualBitwise(t *testing.T) {
	parallelHeavy(t)
	cfgs := variants()
	cfgs["deepseek-v2-lite-scaled"] = scaledPresets()["deepseek-v2-lite"]
	for _, b := range layerBackends(t) {
		for name, cfg := range cfgs {
			w, err := RandomWeights(cfg, 5)
			if err != nil {
				t.Fatal(err)
			}
			for _, dt := range layerDTypes {
				for _, path := range layerPaths {
					t.Run(b.name+"/"+name+"/"+dt.String()+"/"+path.name, func(t *testing.T) {
						l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt, AutoThreshold: 7, SmallBatchTokens: path.small, NoFused: path.noFused})
						if err != nil {
							t.Fatal(err)
						}
						defer l.Close()
						for _, T := range []int{1, 7, 40} {
							x := randomX(T, cfg.HiddenSize, uint64(T))
							single := deviceRun(t, l, x, T, Single, Whole)
							for _, mode := range []Mode{Dual, Single} {
								if got := deviceRun(t, l, x, T, mode, Whole); !bytes.Equal(got, single) {
									t.Errorf("T=%d: %v differs from single (relative %.3g)", T, mode, relErr(l.decode(got), l.decode(single)))
								}
							}
							// Auto runs Single, Dual or FusedShared: bitwise one of them.
							fused := deviceRun(t, l, x, T, FusedShared, Whole)
							if got := deviceRun(t, l, x, T, Auto, Whole); !bytes.Equal(got, single) && !bytes.Equal(got, fused) {
								t.Errorf("T=%d: auto differs from single and from fused (relative %.3g)", T, relErr(l.decode(got), l.decode(single)))
							}
							// Parts: whole = routed + shared, to f32 rounding.
							if dt != gpuctx.F32 || cfg.SharedIntermediate == 0 {
								continue
							}
							whole := l.decode(single)
							routed := l.decode(deviceRun(t, l, x, T, Dual, RoutedOnly))
							for _, mode := range []Mode{Single, Dual} {
								shared := l.decode(deviceRun(t, l, x, T, mode, SharedOnly))
								sum := make([]float32, len(routed))
								for i := range sum {
									sum[i] = routed[i] + shared[i]
								}
								if rel := relErr(sum, whole); !(rel <= 1e-6) {
									t.Errorf("T=%d %v: routed+shared differs from whole by %.3g", T, mode, rel)
								}
								if rel := relErr(routed, whole); !(rel > 1e-4) {
									t.Errorf("T=%d: routed alone equals whole (%.3g): the shared expert is missing", T, rel)
								}
							}
						}
					})
				}
			}
		}
	}
}

// layerPath is one way the routed experts run: grouped GEMMs sized on the host
// ("gemm"), the fused path (bf16 only; f32 layers take the GEMM path), or the
// small-batch kernels planned on the device, forced for any T ("small").
type layerPath struct {
	name    string
	small   int  // LayerOptions.SmallBatchTokens
	noFused bool // LayerOptions.NoFused
}

var layerPaths = []layerPath{{"gemm", -1, true}, {"fused", -1, false}, {"small", 1 << 20, false}}

type modePath struct {
	mode Mode
	path layerPath
}

// modePaths crosses Single and Dual with both paths.
func modePaths() (out []modePath) {
	for _, m := range []Mode{Single, Dual} {
		for _, p := range layerPaths {
			out = append(out, modePath{m, p})
		}
	}
	return out
}

// TestLayerAutoThreshold checks that Auto runs Dual exactly at and above the
// threshold, and that Dual without a shared expert falls back to one stream.
func TestLayerAutoThreshold(t *testing.T) {
	for _, b := range layerBackends(t) {
		for _, name := range []string{"deepseek_v2_greedy", "qwen3_moe"} {
			cfg := variants()[name]
			w, err := RandomWeights(cfg, 2)
			if err != nil {
				t.Fatal(err)
			}
			// The threshold rule alone (no small-batch path), then with the
			// small-batch path up to 3 tokens: Auto is Dual there too.
			for _, small := range []int{-1, 3} {
				l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.F32, Mode: Auto, AutoThreshold: 5, SmallBatchTokens: small})
				if err != nil {
					t.Fatal(err)
				}
				rec := recordPlans(l, nil)
				for _, tc := range []struct {
					T    int
					mode Mode
					want bool
				}{{1, Auto, small > 0}, {3, Auto, small > 0}, {4, Auto, false}, {5, Auto, true}, {9, Auto, true}, {9, Single, false}, {2, Dual, true}, {2, Single, false}} {
					x := randomX(tc.T, cfg.HiddenSize, 1)
					deviceRun(t, l, x, tc.T, tc.mode, Whole)
					want := tc.want && cfg.SharedIntermediate > 0
					if rec.last.dual != want {
						t.Errorf("%s %s small=%d T=%d %v: ran dual = %v, want %v", b.name, name, small, tc.T, tc.mode, rec.last.dual, want)
					}
				}
				l.Close()
			}
		}
	}
}

// TestLayerErrors checks that bad options, bad inputs and a closed layer give
// clear errors, and that a layer still works after refusing bad input.
func TestLayerErrors(t *testing.T) {
	for _, b := range layerBackends(t) {
		cfg := variants()["qwen2_moe"]
		w, err := RandomWeights(cfg, 1)
		if err != nil {
			t.Fatal(err)
		}
		noShared := variants()["qwen3_moe"]
		wq3, err := RandomWeights(noShared, 1)
		if err != nil {
			t.Fatal(err)
		}
		big := *noShared
		big.NumExperts, big.TopK = 600, 2
		wbig, err := RandomWeights(&big, 1)
		if err != nil {
			t.Fatal(err)
		}
		newLayer := func(t *testing.T) *Layer {
			l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.F32})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = l.Close() })
			return l
		}
		H := cfg.HiddenSize
		t.Run(b.name+"/NewLayer", func(t *testing.T) {
			for _, tc := range []struct {
				name string
				dev  *gpuctx.Device
				cfg  *Config
				w    *Weights
				o    LayerOptions
				want string
			}{
				{"f16", b.dev, cfg, w, LayerOptions{DType: gpuctx.F16}, "dtype f16"},
				{"zero dtype", b.dev, cfg, w, LayerOptions{}, "dtype invalid"},
				{"nil device", nil, cfg, w, LayerOptions{DType: gpuctx.F32}, "nil device"},
				{"nil weights", b.dev, cfg, nil, LayerOptions{DType: gpuctx.F32}, "nil *Weights"},
				{"mismatched weights", b.dev, noShared, w, LayerOptions{DType: gpuctx.F32}, "shared expert"},
				{"too many experts", b.dev, &big, wbig, LayerOptions{DType: gpuctx.F32}, "at most 512 experts"},
				{"bad mode", b.dev, cfg, w, LayerOptions{DType: gpuctx.F32, Mode: 7}, "unknown mode"},
				{"negative threshold", b.dev, cfg, w, LayerOptions{DType: gpuctx.F32, AutoThreshold: -1}, "AutoThreshold"},
			} {
				l, err := NewLayer(tc.dev, tc.cfg, tc.w, tc.o)
				if err == nil {
					l.Close()
					t.Errorf("%s: NewLayer succeeded", tc.name)
				} else if !strings.Contains(err.Error(), tc.want) {
					t.Errorf("%s: error %q does not mention %q", tc.name, err, tc.want)
				}
			}
		})
		t.Run(b.name+"/Forward", func(t *testing.T) {
			l := newLayer(t)
			x := randomX(3, H, 1)
			if _, _, err := l.LastRouting(); err == nil || !strings.Contains(err.Error(), "no forward") {
				t.Errorf("LastRouting before any forward: %v", err)
			}
			for _, tc := range []struct {
				name string
				x    []float32
				T    int
				want error
			}{
				{"T=0", nil, 0, gpuctx.ErrInvalid},
				{"T<0", x, -3, gpuctx.ErrInvalid},
				{"short x", x[:len(x)-1], 3, gpuctx.ErrSize},
				{"long x", x, 2, gpuctx.ErrSize},
			} {
				if _, err := l.Forward(tc.x, tc.T); !errors.Is(err, tc.want) {
					t.Errorf("%s: Forward error %v, want %v", tc.name, err, tc.want)
				}
			}
			if _, err := l.Forward(x, 3); err != nil {
				t.Fatalf("good Forward after bad ones: %v", err)
			}
		})
		t.Run(b.name+"/ForwardDevice", func(t *testing.T) {
			l := newLayer(t)
			xb, err := b.dev.Alloc(4 * 4 * H)
			if err != nil {
				t.Fatal(err)
			}
			defer xb.Free()
			yb, err := b.dev.Alloc(4 * 4 * H)
			if err != nil {
				t.Fatal(err)
			}
			defer yb.Free()
			if err := xb.CopyFromHost(make([]byte, xb.Size())); err != nil {
				t.Fatal(err)
			}
			lq3, err := NewLayer(b.dev, noShared, wq3, LayerOptions{DType: gpuctx.F32})
			if err != nil {
				t.Fatal(err)
			}
			defer lq3.Close()
			for _, tc := range []struct {
				name    string
				l       *Layer
				x, y    *gpuctx.Buffer
				T       int
				mode    Mode
				part    Part
				want    error
				wantMsg string
			}{
				{"T=0", l, xb, yb, 0, Single, Whole, gpuctx.ErrInvalid, "T = 0"},
				{"x too small", l, xb, yb, 5, Single, Whole, gpuctx.ErrSize, "x holds"},
				{"nil y", l, xb, nil, 2, Single, Whole, gpuctx.ErrInvalid, "y is nil"},
				{"bad mode", l, xb, yb, 2, Mode(9), Whole, gpuctx.ErrInvalid, "unknown mode"},
				{"bad part", l, xb, yb, 2, Dual, Part(5), gpuctx.ErrInvalid, "unknown part"},
				{"shared only without shared expert", lq3, xb, yb, 2, Dual, SharedOnly, gpuctx.ErrInvalid, "no shared expert"},
			} {
				err := tc.l.ForwardDevice(tc.x, tc.y, tc.T, tc.mode, tc.part)
				if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.wantMsg) {
					t.Errorf("%s: error %v, want %v mentioning %q", tc.name, err, tc.want, tc.wantMsg)
				}
			}
			// A layer without a shared expert runs every mode, RoutedOnly included.
			for _, mode := range []Mode{Single, Dual, Auto} {
				if err := lq3.ForwardDevice(xb, yb, 4, mode, RoutedOnly); err != nil {
					t.Errorf("no shared expert, %v RoutedOnly: %v", mode, err)
				}
			}
		})
		t.Run(b.name+"/Closed", func(t *testing.T) {
			l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, Mode: Dual})
			if err != nil {
				t.Fatal(err)
			}
			x := randomX(2, H, 1)
			if _, err := l.Forward(x, 2); err != nil {
				t.Fatal(err)
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			if err := l.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
			xb, err := b.dev.Alloc(2 * 2 * H)
			if err != nil {
				t.Fatal(err)
			}
			defer xb.Free()
			if _, err := l.Forward(x, 2); !errors.Is(err, gpuctx.ErrClosed) {
				t.Errorf("Forward after Close: %v, want ErrClosed", err)
			}
			if err := l.ForwardDevice(xb, xb, 2, Single, Whole); !errors.Is(err, gpuctx.ErrClosed) {
				t.Errorf("ForwardDevice after Close: %v, want ErrClosed", err)
			}
			if _, _, err := l.LastRouting(); !errors.Is(err, gpuctx.ErrClosed) {
				t.Errorf("LastRouting after Close: %v, want ErrClosed", err)
			}
		})
	}
}

func TestModeAndPart(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Mode
		ok   bool
	}{{"single", Single, true}, {"Dual", Dual, true}, {" auto ", Auto, true}, {"both", 0, false}, {"", 0, false}} {
		got, err := ParseMode(tc.in)
		if (err == nil) != tc.ok || (tc.ok && got != tc.want) {
			t.Errorf("ParseMode(%q) = %v, %v", tc.in, got, err)
		}
		if tc.ok && got.String() != strings.ToLower(strings.TrimSpace(tc.in)) {
			t.Errorf("%v.String() = %q", got, got.String())
		}
	}
	if s := Mode(7).String(); s != "Mode(7)" {
		t.Errorf("Mode(7).String() = %q", s)
	}
	if s := RoutedOnly.String() + SharedOnly.String() + Whole.String(); s != "routedsharedwhole" {
		t.Errorf("Part strings: %q", s)
	}
}

// TestWeightBytes checks the weight-byte estimate against a hand count.
func TestWeightBytes(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	cfg := variants()["qwen2_moe"] // H 16, E 8, K 3, I 8, shared 24 with a gate
	w, _ := RandomWeights(cfg, 1)
	l, err := NewLayer(dev, cfg, w, LayerOptions{DType: gpuctx.BF16})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	fixed := int64(8*16+3*16*24+16) * 2
	expert := int64(3*16*8) * 2
	for _, tc := range []struct {
		T    int
		idx  []int32
		want int64
	}{
		{1, nil, fixed + 3*expert},
		{100, nil, fixed + 8*expert},
		{2, []int32{1, 2, 3, 3, 2, 5}, fixed + 4*expert},
	} {
		if got := l.WeightBytes(tc.T, tc.idx); got != tc.want {
			t.Errorf("WeightBytes(%d, %v) = %d, want %d", tc.T, tc.idx, got, tc.want)
		}
	}
}

// TestLayerGraphReplay runs the same small batch several times, so that the
// forward is run eagerly, then captured, then replayed; every run must give the
// bytes of a layer that never captures, in both modes and for every part, and
// new inputs must flow through the replayed graph.
func TestLayerGraphReplay(t *testing.T) {
	parallelHeavy(t)
	cfg := scaledPresets()["deepseek-v2-lite"]
	w, err := RandomWeights(cfg, 21)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range layerBackends(t) {
		for _, dt := range layerDTypes {
			t.Run(b.name+"/"+dt.String(), func(t *testing.T) {
				eager, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt, NoGraphs: true})
				if err != nil {
					t.Fatal(err)
				}
				defer eager.Close()
				graphed, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt})
				if err != nil {
					t.Fatal(err)
				}
				defer graphed.Close()
				for run := range 8 {
					T := []int{5, 40}[run%2]                         // the small-batch path and the fused (bf16) or GEMM path
					x := randomX(T, cfg.HiddenSize, uint64(100+run)) // new inputs every run
					for _, mode := range []Mode{Single, Dual} {
						for _, part := range []Part{Whole, RoutedOnly, SharedOnly} {
							if T > DefaultSmallBatchTokens && dt == gpuctx.F32 && part != SharedOnly {
								continue // the f32 GEMM path waits for the host: never captured
							}
							want := deviceRun(t, eager, x, T, mode, part)
							if got := deviceRun(t, graphed, x, T, mode, part); !bytes.Equal(got, want) {
								t.Fatalf("run %d %v %v: the graphed layer differs from the eager one (relative %.3g)",
									run, mode, part, relErr(graphed.decode(got), eager.decode(want)))
							}
						}
					}
				}
				if len(graphed.gc.graphs) == 0 {
					t.Fatal("no forward was captured into a graph")
				}
				if len(eager.gc.graphs) != 0 {
					t.Fatal("NoGraphs layer captured a graph")
				}
			})
		}
	}
}

// TestLayerFusedTiles runs the fused path with every tile config forced and
// checks each gives the bits of the default choice, on batches that leave
// experts empty, partly filled and over several row blocks, and the
// reference within bf16 tolerance. Every tile sums each output's K dimension
// in the same order, 16 at a time; the warpgroup (wgmma) tiles do it with
// another instruction than the mma.sync ones, and on the H200 it rounds the
// same way (bench/RESULTS.md, 2026-12-01), which this test holds it to. A
// warpgroup tile on a GPU other than compute capability 9.0 is skipped.
func TestLayerFusedTiles(t *testing.T) {
	parallelHeavy(t)
	cfg := scaledPresets()["deepseek-v2-lite"]
	w, err := RandomWeights(cfg, 8)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range layerBackends(t) {
		ref, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1, NoAutotune: true}) // the rule's tile: no timing runs (racecheck)
		if err != nil {
			t.Fatal(err)
		}
		defer ref.Close()
		for _, tile := range moekernels.MoEGemms {
			t.Run(b.name+"/"+tile.Tag(), func(t *testing.T) {
				if tile.Warpgroups > 0 && b.name != "cpu" {
					if _, err := b.dev.Kernel(tile.DownName()); errors.Is(err, gpuctx.ErrUnavailable) {
						t.Skipf("warpgroup tile on %s: %v", b.dev.Info().Name, firstLine(err))
					}
				}
				l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1, Tile: tile.Tag()})
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				// Under -race or -short 3 (empty and partly filled experts)
				// and 40; the plain run adds 1 and 300 (several row blocks).
				for _, T := range heavyShapes([]int{1, 3, 40, 300}, []int{3, 40}) {
					x := randomX(T, cfg.HiddenSize, uint64(T))
					want := deviceRun(t, ref, x, T, Single, Whole)
					if got := deviceRun(t, l, x, T, Single, Whole); !bytes.Equal(got, want) {
						t.Errorf("T=%d: tile %s differs from the default tile (relative %.3g)", T, tile.Tag(), relErr(l.decode(got), ref.decode(want)))
					}
					wr, xr := roundWeights(w), roundAll(x)
					refY, err := Reference(cfg, wr, xr, T)
					if err != nil {
						t.Fatal(err)
					}
					checkClose(t, fmt.Sprintf("T=%d tile %s vs reference", T, tile.Tag()), l.decode(deviceRun(t, l, x, T, Dual, Whole)), refY, nil, 2e-2)
				}
			})
		}
	}
}

// TestLayerFusedShared checks FusedShared mode: where the shared expert can be
// fused (bf16, its width a multiple of the routed width, no shared gate) the
// forward matches the reference and Dual to bf16 rounding, keeps the routing,
// replays bitwise, and really skips the side stream; elsewhere (f32, a shared
// gate, the small-batch path) it is Dual, bit for bit.
func TestLayerFusedShared(t *testing.T) {
	presets := scaledPresets()
	for _, b := range layerBackends(t) {
		for _, name := range []string{"deepseek-v2-lite", "deepseek-v3", "qwen1.5-moe"} {
			cfg := presets[name]
			w, err := RandomWeights(cfg, 17)
			if err != nil {
				t.Fatal(err)
			}
			for _, dt := range layerDTypes {
				t.Run(b.name+"/"+name+"/"+dt.String(), func(t *testing.T) {
					l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt, SmallBatchTokens: 2})
					if err != nil {
						t.Fatal(err)
					}
					defer l.Close()
					rec := recordPlans(l, nil)
					fusable := dt == gpuctx.BF16 && w.SharedGate == nil
					if got := l.ns > 0; got != fusable {
						t.Fatalf("shared expert fused = %v, want %v", got, fusable)
					}
					// Under -race or -short: the small-batch fallback (1) and
					// two fused batches; the plain run adds 300.
					for _, T := range heavyShapes([]int{1, 3, 40, 300}, []int{1, 3, 40}) {
						x := randomX(T, cfg.HiddenSize, uint64(T)+50)
						dual := deviceRun(t, l, x, T, Dual, Whole)
						dualIdx, _, err := l.LastRouting()
						if err != nil {
							t.Fatal(err)
						}
						fused := deviceRun(t, l, x, T, FusedShared, Whole)
						if rec.last.fusedShared() != (fusable && T > 2) || rec.last.dual == rec.last.fusedShared() {
							t.Fatalf("T=%d: fused shared %v, side stream %v", T, rec.last.fusedShared(), rec.last.dual)
						}
						idx, _, err := l.LastRouting()
						if err != nil {
							t.Fatal(err)
						}
						if !slices.Equal(idx, dualIdx) {
							t.Errorf("T=%d: FusedShared routed differently from Dual", T)
						}
						for run := 0; run < 2; run++ { // graph capture, then replay
							if again := deviceRun(t, l, x, T, FusedShared, Whole); !bytes.Equal(again, fused) {
								t.Fatalf("T=%d run %d: FusedShared is not reproducible", T, run)
							}
						}
						if !rec.last.fusedShared() {
							if !bytes.Equal(fused, dual) {
								t.Errorf("T=%d: FusedShared fell back but differs from Dual", T)
							}
							continue
						}
						checkClose(t, fmt.Sprintf("T=%d FusedShared vs Dual", T), l.decode(fused), l.decode(dual), nil, 2e-2)
						ref, err := Reference(cfg, roundWeights(w), roundAll(x), T)
						if err != nil {
							t.Fatal(err)
						}
						checkClose(t, fmt.Sprintf("T=%d FusedShared vs reference", T), l.decode(fused), ref, nil, 2e-2)
						routed := l.decode(deviceRun(t, l, x, T, FusedShared, RoutedOnly))
						if rel := relErr(routed, l.decode(fused)); !(rel > 1e-2) {
							t.Errorf("T=%d: routed alone equals FusedShared whole (%.3g): the shared expert is missing", T, rel)
						}
					}
				})
			}
		}
	}
}

// TestLayerSharedRowsEarly checks the up kernel's fused shared-expert blocks,
// which start before the sort ends and compute their rows themselves
// (moe_shared_rows): FusedShared gives the same bits as a layer whose up
// kernel reads those rows from the sort after its wait, like every other row
// (sharedWait). It runs the one-launch routing (T <= 16), the router GEMM with
// the one-block align, and the three-launch align (T*(K+ns) >= 4096), for
// tiles of 16 rows, one and two warpgroups, and a persistent one (which always
// waits), with two shared chunks (DeepSeek-V2-Lite) and one (DeepSeek-V3).
func TestLayerSharedRowsEarly(t *testing.T) {
	presets := scaledPresets()
	for _, b := range layerBackends(t) {
		for _, name := range []string{"deepseek-v2-lite", "deepseek-v3"} {
			cfg := presets[name]
			w, err := RandomWeights(cfg, 23)
			if err != nil {
				t.Fatal(err)
			}
			for _, tile := range []string{"m16n64k64w1x4s6", "m64n64k64g1s4", "m128n128k64g2s3", "m128n128k64g2s4p4"} {
				t.Run(b.name+"/"+name+"/"+tile, func(t *testing.T) {
					var recs []*planRecorder
					layer := func(wait bool) *Layer {
						l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1, Tile: tile})
						if err != nil {
							if errors.Is(err, gpuctx.ErrUnavailable) {
								t.Skipf("tile %s on %s: %v", tile, b.dev.Info().Name, firstLine(err))
							}
							t.Fatal(err)
						}
						t.Cleanup(func() { l.Close() })
						recs = append(recs, recordPlans(l, func(p *plan) {
							if wait {
								p.early = 0
							}
						}))
						return l
					}
					early, waits := layer(false), layer(true)
					if early.ns == 0 {
						t.Fatal("the shared expert is not fused: the test is vacuous")
					}
					// Under -race or -short the one-launch routing (1) and the
					// router GEMM with the one-block align (40); the plain run
					// adds the three-launch align (also TestAlignThreeLaunch's).
					for _, T := range heavyShapes([]int{1, 3, 17, 40, 4096/(cfg.TopK+early.ns) + 5}, []int{1, 40}) {
						x := randomX(T, cfg.HiddenSize, uint64(T)+70)
						got := deviceRun(t, early, x, T, FusedShared, Whole)
						if p := recs[0].last; !p.fusedShared() || p.ks-cfg.TopK != early.ns {
							t.Fatalf("T=%d: fused shared %v with %d chunks in the sort, want true and %d", T, p.fusedShared(), p.ks-cfg.TopK, early.ns)
						}
						if want := deviceRun(t, waits, x, T, FusedShared, Whole); !bytes.Equal(got, want) {
							t.Errorf("T=%d: the early shared rows differ from the sorted ones (relative %.3g)", T, relErr(early.decode(got), waits.decode(want)))
						}
						if again := deviceRun(t, early, x, T, FusedShared, Whole); !bytes.Equal(again, got) { // the captured graph
							t.Errorf("T=%d: the replayed graph differs", T)
						}
						routed := early.decode(deviceRun(t, early, x, T, FusedShared, RoutedOnly))
						if rel := relErr(routed, early.decode(got)); !(rel > 1e-2) {
							t.Errorf("T=%d: routed alone equals the whole forward (%.3g): the shared expert is missing", T, rel)
						}
					}
				})
			}
		}
	}
}

// TestLayerDirectGraphs checks the graphs captured on the caller's own x and
// y: a forward that reuses its buffers replays without staging copies, gives
// the eager layer's bits on new contents every run (x == y too), and a freed
// buffer is an error, not a replay on freed memory.
func TestLayerDirectGraphs(t *testing.T) {
	cfg := scaledPresets()["deepseek-v2-lite"]
	w, err := RandomWeights(cfg, 23)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range layerBackends(t) {
		for _, dt := range layerDTypes {
			t.Run(b.name+"/"+dt.String(), func(t *testing.T) {
				eager, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt, NoGraphs: true})
				if err != nil {
					t.Fatal(err)
				}
				defer eager.Close()
				l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt})
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				const T = 5
				n := T * cfg.HiddenSize * l.es
				xb, err := b.dev.Alloc(n)
				if err != nil {
					t.Fatal(err)
				}
				yb, err := b.dev.Alloc(n)
				if err != nil {
					t.Fatal(err)
				}
				defer yb.Free()
				run := func(x, y *gpuctx.Buffer, in []float32, mode Mode) []byte {
					t.Helper()
					if err := x.CopyFromHost(l.encode(in)); err != nil {
						t.Fatal(err)
					}
					if err := l.ForwardDevice(x, y, T, mode, Whole); err != nil {
						t.Fatal(err)
					}
					out := make([]byte, n)
					if err := l.MainStream().Synchronize(); err != nil {
						t.Fatal(err)
					}
					if err := y.CopyToHost(out); err != nil {
						t.Fatal(err)
					}
					return out
				}
				for i := range 6 {
					x := randomX(T, cfg.HiddenSize, uint64(300+i))
					mode := []Mode{Single, Dual}[i%2]
					want := deviceRun(t, eager, x, T, mode, Whole)
					if got := run(xb, yb, x, mode); !bytes.Equal(got, want) {
						t.Fatalf("run %d %v: differs from the eager layer", i, mode)
					}
					if got := run(xb, xb, x, mode); !bytes.Equal(got, want) { // y == x
						t.Fatalf("run %d %v, y == x: differs from the eager layer", i, mode)
					}
				}
				if b.name == "cuda" || len(l.gc.graphs) > 0 { // the backend captures
					if len(l.gc.direct) == 0 {
						t.Fatal("no forward was captured on the caller's buffers")
					}
				}
				if err := xb.Free(); err != nil {
					t.Fatal(err)
				}
				if err := l.ForwardDevice(xb, yb, T, Single, Whole); err == nil {
					t.Fatal("ForwardDevice on a freed x succeeded")
				}
			})
		}
	}
}

// autoLayers are the layers of the Auto tests: a bf16 layer on the fused
// path and an FP8 one, each with a shared expert it can fuse, and the
// largest batch for which Auto's rule (NoAutotune) runs FusedShared.
func autoLayers() []struct {
	name      string
	cfg       *Config
	opts      LayerOptions
	ruleFused int
} {
	return []struct {
		name      string
		cfg       *Config
		opts      LayerOptions
		ruleFused int
	}{
		{"bf16", scaledPresets()["deepseek-v2-lite"], LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1}, autoRuleTokens},
		{"fp8", fp8Configs()["deepseek_v2_greedy"], LayerOptions{DType: gpuctx.BF16, FP8: true}, 0}, // Dual at every size
	}
}

// TestLayerAutoMeasured checks that Auto on the fused path with a fusable
// shared expert, bf16 or FP8, measures Dual and FusedShared once per token
// bucket (its line in TileChoices names both timings, not the rule), keeps
// the choice, and returns the chosen mode's bits. FP8 layers took the
// token-count rule until session 16, which ran FusedShared at one token
// where Dual was faster on the H200.
func TestLayerAutoMeasured(t *testing.T) {
	for _, lc := range autoLayers() {
		w, err := RandomWeights(lc.cfg, 29)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range layerBackends(t) {
			t.Run(lc.name+"/"+b.name, func(t *testing.T) {
				l, err := NewLayer(b.dev, lc.cfg, w, lc.opts)
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				if l.ns == 0 {
					t.Fatal("the shared expert is not fused: the test is vacuous")
				}
				for _, T := range []int{3, 4, 40} { // 3 and 4 share a bucket
					x := randomX(T, lc.cfg.HiddenSize, uint64(T)+7)
					got := deviceRun(t, l, x, T, Auto, Whole)
					m, ok := l.tuner.autoModes[tileBucket(T)]
					if !ok || (m != Dual && m != FusedShared) {
						t.Fatalf("T=%d: Auto recorded %v (%v), want Dual or FusedShared", T, m, ok)
					}
					if want := deviceRun(t, l, x, T, m, Whole); !bytes.Equal(got, want) {
						t.Errorf("T=%d: Auto differs from %v, the mode it picked", T, m)
					}
				}
				var timed []string
				for _, line := range l.TileChoices() {
					if strings.Contains(line, "auto runs") {
						if !strings.Contains(line, "(dual ") || !strings.Contains(line, ", fused ") || strings.Contains(line, "rule") {
							t.Errorf("Auto's line names no timing of both modes: %q", line)
						}
						timed = append(timed, line)
					}
				}
				if len(timed) != 2 {
					t.Errorf("Auto measured %d times for 2 buckets: %q", len(timed), timed)
				}
			})
		}
	}
}

// TestLayerAutoRule checks Auto under NoAutotune: no timing runs; a bf16
// layer FusedShared up to autoRuleTokens tokens and Dual above, an FP8 one
// Dual at every size; with that mode's bits.
func TestLayerAutoRule(t *testing.T) {
	for _, lc := range autoLayers() {
		w, err := RandomWeights(lc.cfg, 29)
		if err != nil {
			t.Fatal(err)
		}
		opts := lc.opts
		opts.NoAutotune = true
		for _, b := range layerBackends(t) {
			t.Run(lc.name+"/"+b.name, func(t *testing.T) {
				l, err := NewLayer(b.dev, lc.cfg, w, opts)
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				if l.ns == 0 {
					t.Fatal("the shared expert is not fused: the test is vacuous")
				}
				for _, T := range []int{1, autoRuleTokens, autoRuleTokens + 1, 40} {
					want := Dual
					if T <= lc.ruleFused {
						want = FusedShared
					}
					x := randomX(T, lc.cfg.HiddenSize, uint64(T)+3)
					got := deviceRun(t, l, x, T, Auto, Whole)
					if m := l.tuner.autoModes[tileBucket(T)]; m != want {
						t.Errorf("T=%d: Auto picked %v, want %v", T, m, want)
					}
					if wb := deviceRun(t, l, x, T, want, Whole); !bytes.Equal(got, wb) {
						t.Errorf("T=%d: Auto differs from %v", T, want)
					}
				}
				for _, line := range l.TileChoices() {
					if strings.Contains(line, "auto runs") && !strings.Contains(line, "rule") {
						t.Errorf("NoAutotune layer timed Auto's modes: %q", line)
					}
				}
			})
		}
	}
}

// TestLayerMisalignedBuffers runs x and y at an offset of 2 bytes (bf16) or 4
// bytes (f32) into their allocations: the device-planned kernels need 16-byte
// rows, so the layer stages them, and the result equals the aligned run's.
func TestLayerMisalignedBuffers(t *testing.T) {
	cfg := scaledPresets()["deepseek-v2-lite"]
	w, err := RandomWeights(cfg, 31)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range layerBackends(t) {
		for _, dt := range layerDTypes {
			for _, graphs := range []bool{true, false} {
				t.Run(fmt.Sprintf("%s/%v/graphs=%v", b.name, dt, graphs), func(t *testing.T) {
					l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: dt, NoGraphs: !graphs})
					if err != nil {
						t.Fatal(err)
					}
					defer l.Close()
					rec := recordPlans(l, nil)
					for _, T := range []int{3, 40} {
						x := randomX(T, cfg.HiddenSize, uint64(T)+3)
						want := deviceRun(t, l, x, T, Dual, Whole)
						n := T * cfg.HiddenSize * l.es
						xa, err := b.dev.Alloc(n + 64)
						if err != nil {
							t.Fatal(err)
						}
						defer xa.Free()
						ya, err := b.dev.Alloc(n + 64)
						if err != nil {
							t.Fatal(err)
						}
						defer ya.Free()
						xb, err := xa.Slice(l.es, n)
						if err != nil {
							t.Fatal(err)
						}
						yb, err := ya.Slice(l.es, n)
						if err != nil {
							t.Fatal(err)
						}
						if err := xb.CopyFromHost(l.encode(x)); err != nil {
							t.Fatal(err)
						}
						for run := 0; run < 3; run++ {
							if err := l.ForwardDevice(xb, yb, T, Dual, Whole); err != nil {
								t.Fatal(err)
							}
							staged := rec.last.staged
							if err := l.MainStream().Synchronize(); err != nil {
								t.Fatal(err)
							}
							got := make([]byte, n)
							if err := yb.CopyToHost(got); err != nil {
								t.Fatal(err)
							}
							if !bytes.Equal(got, want) {
								t.Fatalf("T=%d run %d: misaligned buffers give other bits than aligned ones", T, run)
							}
							if routesOnDevice := l.smallBatch(T) || l.fused(T); staged != routesOnDevice {
								t.Errorf("T=%d: staged = %v, want %v", T, staged, routesOnDevice)
							}
						}
					}
				})
			}
		}
	}
}

// TestRuleTilesExist checks that the rule of thumb only names compiled tiles.
func TestRuleTilesExist(t *testing.T) {
	for _, T := range []int{1, 8, 64, 256, 1024, 4096} {
		c := ruleTile(T, 6, 64)
		if _, err := parseTile(c.Tag()); err != nil {
			t.Errorf("T=%d: rule tile %s: %v", T, c.Tag(), err)
		}
	}
}

// TestForcedPairs checks the pair a forced tile runs: itself twice when it
// has an up kernel; for a down-only tile, itself as down and an up tile of the
// same BM and family (they share one alignment), never a tile without an up
// kernel.
func TestForcedPairs(t *testing.T) {
	downOnly := 0
	for _, c := range moekernels.MoEGemms {
		p := forcedPair(c)
		switch {
		case !p.up.HasUp():
			t.Errorf("tile %s: forced up tile %s has no up kernel", c.Tag(), p.up.Tag())
		case p.down != c:
			t.Errorf("tile %s: forced down tile %s", c.Tag(), p.down.Tag())
		case p.up.BM != c.BM || (p.up.Warpgroups > 0) != (c.Warpgroups > 0):
			t.Errorf("tile %s: forced up tile %s of another BM or family", c.Tag(), p.up.Tag())
		case c.HasUp() && p.up != c:
			t.Errorf("tile %s: forced up tile %s, want itself", c.Tag(), p.up.Tag())
		}
		if !c.HasUp() {
			downOnly++
		}
	}
	if downOnly == 0 {
		t.Error("no down-only tile listed: this test checks nothing")
	}
}

// TestAlignThreeLaunch checks the three-launch aligned sort a large batch
// uses against gpuctx_moe_align's one block, on each backend: the same sorted
// rows, block experts and padded count (read back from the layer's scratch)
// and the same output bits, for a batch whose assignments span several chunks.
func TestAlignThreeLaunch(t *testing.T) {
	parallelHeavy(t)
	cfg := scaledPresets()["deepseek-v2-lite"]
	w, err := RandomWeights(cfg, 5)
	if err != nil {
		t.Fatal(err)
	}
	T := 3*moekernels.AlignChunk/cfg.TopK + 41
	x := randomX(T, cfg.HiddenSize, 9)
	for _, b := range layerBackends(t) {
		t.Run(b.name, func(t *testing.T) {
			var outs [2][]byte
			var sorts [2][3][]int32
			for i, from := range []int{math.MaxInt, 1} {
				l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1, Tile: "m64n64k64w2x2s4"})
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				l.dispatch.align3From = from
				rec := recordPlans(l, nil)
				outs[i] = deviceRun(t, l, x, T, Single, Whole)
				TK := T * rec.last.ks
				cp := moekernels.AlignCap(TK, rec.last.experts, 64)
				for j, buf := range []struct {
					b *gpuctx.Buffer
					n int
				}{{l.dispatch.sorted, cp}, {l.dispatch.bexp, cp / 64}, {l.dispatch.npost, 1}} {
					host := make([]byte, 4*buf.n)
					part, err := buf.b.Slice(0, len(host))
					if err != nil {
						t.Fatal(err)
					}
					if err := part.CopyToHost(host); err != nil {
						t.Fatal(err)
					}
					sorts[i][j] = make([]int32, buf.n)
					for k := range sorts[i][j] {
						sorts[i][j][k] = int32(binary.LittleEndian.Uint32(host[4*k:]))
					}
				}
			}
			if TK := T * cfg.TopK; TK <= 2*moekernels.AlignChunk {
				t.Fatalf("TK = %d spans fewer than three chunks", TK)
			}
			for j, what := range []string{"sorted", "block_expert", "npost"} {
				if !slices.Equal(sorts[0][j], sorts[1][j]) {
					t.Errorf("%s differs between the one-block and the three-launch align", what)
				}
			}
			if !bytes.Equal(outs[0], outs[1]) {
				t.Error("outputs differ between the one-block and the three-launch align")
			}
		})
	}
}

// TestRouteAlignOneLaunch checks the one-launch router + routing + sort
// (gpuctx_moe_route_align, one block per 16 router logits, the last block
// routing): its routing equals Route on forwards that alternate two inputs
// (eager, captured, then replayed: the last-block ticket must be back at 0
// after every launch, or a later forward keeps a stale routing), and its
// output matches the three-launch path (router GEMM, route, align).
func TestRouteAlignOneLaunch(t *testing.T) {
	for _, b := range layerBackends(t) {
		for _, name := range []string{"deepseek-v2-lite", "qwen3-30b-a3b", "deepseek-v3"} {
			cfg := scaledPresets()[name]
			w, err := RandomWeights(cfg, 21)
			if err != nil {
				t.Fatal(err)
			}
			wr := roundWeights(w)
			for _, T := range []int{1, 5, 16} {
				t.Run(fmt.Sprintf("%s/%s/T=%d", b.name, name, T), func(t *testing.T) {
					one, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1})
					if err != nil {
						t.Fatal(err)
					}
					defer one.Close()
					three, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1})
					if err != nil {
						t.Fatal(err)
					}
					defer three.Close()
					three.dispatch.raTokens = 0
					if !one.routeAlignOK(T) || three.routeAlignOK(T) {
						t.Fatalf("routeAlignOK(%d) = %v and %v, want true and false", T, one.routeAlignOK(T), three.routeAlignOK(T))
					}
					xs := [2][]float32{randomX(T, cfg.HiddenSize, 31), randomX(T, cfg.HiddenSize, 32)}
					var idx [2][]int32
					for i := range 6 {
						x := xs[i%2]
						y := deviceRun(t, one, x, T, Single, Whole)
						got, _, err := one.LastRouting()
						if err != nil {
							t.Fatal(err)
						}
						idx[i%2] = got
						checkRouting(t, one, cfg, wr, roundAll(x), T)
						if i < 2 {
							want := deviceRun(t, three, x, T, Single, Whole)
							checkClose(t, "one launch vs router GEMM + route + align", one.decode(y), three.decode(want), nil, 2e-2)
						}
					}
					if slices.Equal(idx[0], idx[1]) {
						t.Fatal("the two inputs route alike: the test cannot see a stale routing")
					}
				})
			}
		}
	}
}

// TestRouteKernelTies runs gpuctx_moe_route on every backend with logits that
// tie, scores that are zero or negative (masked groups, negative bias) and
// -inf, and checks the experts it picks against Route's rule (larger choice
// first, ties to the lower index) as the CPU backend's Go body computes it:
// on CUDA the selection takes the warp-reduction path (no NaN), which must
// pick what the shuffle path picks.
func TestRouteKernelTies(t *testing.T) {
	// Two, four, five and ten experts per lane (320: past the first eight
	// entries of each lane's arrays, which hold MOE_MAX_E/32).
	for _, E := range []int{64, 128, 160, 320} {
		t.Run(fmt.Sprintf("E=%d", E), func(t *testing.T) { routeKernelTies(t, E) })
	}
}

func routeKernelTies(t *testing.T, E int) {
	const K = 6
	ninf := float32(math.Inf(-1))
	type tc struct {
		name                    string
		logits, bias            []float32
		scoring, method, groups int32
		topkGroups              int32
	}
	same := make([]float32, E)
	pairs := make([]float32, E)
	steps := make([]float32, E)
	withInf := make([]float32, E)
	negBias := make([]float32, E)
	for e := range E {
		pairs[e] = float32(e / 2 % 5)   // ties in pairs and across the warp's lanes
		steps[e] = float32((E - e) % 3) // three values, many ties
		withInf[e] = ninf
		negBias[e] = -2 - float32(e%4)/4
	}
	withInf[40], withInf[7], withInf[9] = 1, 1, 0.5
	cases := []tc{
		{"all equal", same, nil, 0, 0, 1, 1},
		{"pairs", pairs, nil, 0, 0, 1, 1},
		{"three values", steps, nil, 0, 0, 1, 1},
		{"minus infinity", withInf, nil, 0, 0, 1, 1},
		{"sigmoid, negative bias, masked groups", steps, negBias, 1, 2, 8, 2},
		{"group limited ties", pairs, nil, 0, 1, 8, 3},
	}
	var want map[string][]int32
	var wantW map[string][]float32
	for _, b := range layerBackends(t) {
		got, gotW := map[string][]int32{}, map[string][]float32{}
		for _, c := range cases {
			t.Run(b.name+"/"+c.name, func(t *testing.T) {
				k, err := b.dev.Kernel("gpuctx_moe_route")
				if err != nil {
					t.Fatal(err)
				}
				st, err := b.dev.NewStream(gpuctx.StreamOptions{})
				if err != nil {
					t.Fatal(err)
				}
				defer st.Close()
				bias := c.bias
				if bias == nil {
					bias = make([]float32, E)
				}
				var bufs []*gpuctx.Buffer
				mk := func(data []byte, n int) *gpuctx.Buffer {
					buf, err := b.dev.Alloc(n)
					if err != nil {
						t.Fatal(err)
					}
					bufs = append(bufs, buf)
					if data != nil {
						if err := buf.CopyFromHost(data); err != nil {
							t.Fatal(err)
						}
					}
					return buf
				}
				defer func() {
					for _, buf := range bufs {
						_ = buf.Free()
					}
				}()
				lg, bb := mk(f32Bytes(c.logits), 4*E), mk(f32Bytes(bias), 4*E)
				idx, w := mk(nil, 4*K), mk(nil, 4*K)
				hasBias := int32(0)
				if c.bias != nil {
					hasBias = 1
				}
				if err := st.Launch(k, gpuctx.Dim3{X: 1, Y: 1, Z: 1}, gpuctx.Dim3{X: 32, Y: 1, Z: 1}, 0,
					lg, bb, idx, w, int32(1), int32(E), int32(K), c.scoring, c.method, c.groups, c.topkGroups,
					hasBias, int32(0), float32(0), float32(1), int32(K), int32(0)); err != nil {
					t.Fatal(err)
				}
				if err := st.Synchronize(); err != nil {
					t.Fatal(err)
				}
				host, hw := make([]byte, 4*K), make([]byte, 4*K)
				if err := idx.CopyToHost(host); err != nil {
					t.Fatal(err)
				}
				if err := w.CopyToHost(hw); err != nil {
					t.Fatal(err)
				}
				ids := make([]int32, K)
				ws := make([]float32, K)
				for i := range ids {
					ids[i] = int32(binary.LittleEndian.Uint32(host[4*i:]))
					ws[i] = math.Float32frombits(binary.LittleEndian.Uint32(hw[4*i:]))
				}
				got[c.name], gotW[c.name] = ids, ws
				if want != nil && !slices.Equal(ids, want[c.name]) {
					t.Errorf("picked %v, the CPU backend %v", ids, want[c.name])
				}
				if want != nil {
					// The weights divide by a softmax sum that the CPU backend
					// adds in expert order and the kernel lane by lane, then
					// across the warp: two orders of E positive f32 terms, each
					// within (E-1)·2^-24 of the exact sum, relative (at E=320
					// "pairs" the two differ by 1.2e-6).
					tol := max(1e-6, 2*float64(E)*0x1p-24)
					for i := range ws {
						if d := math.Abs(float64(ws[i] - wantW[c.name][i])); d > tol*math.Abs(float64(wantW[c.name][i])) {
							t.Errorf("slot %d: weight %g, the CPU backend %g", i, ws[i], wantW[c.name][i])
						}
					}
				}
			})
		}
		if want == nil {
			want, wantW = got, gotW
		}
	}
	if !slices.Equal(want["all equal"], []int32{0, 1, 2, 3, 4, 5}) {
		t.Errorf("all equal: picked %v, want the lowest indices 0..5", want["all equal"])
	}
	if !slices.Equal(want["minus infinity"], []int32{7, 40, 9, 0, 1, 2}) {
		t.Errorf("minus infinity: picked %v, want 7 40 9 0 1 2", want["minus infinity"])
	}
}

// TestLayerFusedSharedLimit checks the align kernel's limit on the experts it
// sorts (MaxExperts) where FusedShared adds the shared expert's chunks to the
// routed experts: a layer whose sum passes it refuses FusedShared, when built
// and when a batch asks for it, with an error naming the limit, and still
// runs Dual and Auto (which then cannot fuse); at the limit it fuses.
func TestLayerFusedSharedLimit(t *testing.T) {
	for _, b := range layerBackends(t) {
		for _, tc := range []struct {
			name    string
			experts int // routed; the shared expert adds 4 chunks
			fuses   bool
		}{{"at the limit", MaxExperts - 4, true}, {"over the limit", MaxExperts - 3, false}} {
			t.Run(b.name+"/"+tc.name, func(t *testing.T) {
				cfg := DeepseekV2Lite()
				cfg.HiddenSize, cfg.NumExperts, cfg.TopK, cfg.Intermediate, cfg.SharedIntermediate = 64, tc.experts, 2, 16, 64
				w, err := RandomWeights(cfg, 5)
				if err != nil {
					t.Fatal(err)
				}
				o := LayerOptions{DType: gpuctx.BF16, Mode: FusedShared, NoAutotune: true}
				if l, err := NewLayer(b.dev, cfg, w, o); tc.fuses {
					if err != nil {
						t.Fatal(err)
					}
					l.Close()
				} else if err == nil || !errors.Is(err, gpuctx.ErrInvalid) || !strings.Contains(err.Error(), "512") {
					if l != nil {
						l.Close()
					}
					t.Fatalf("NewLayer with FusedShared over the limit: err = %v, want ErrInvalid naming 512", err)
				}
				o.Mode = Dual
				l, err := NewLayer(b.dev, cfg, w, o)
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				const T = 5
				x := randomX(T, cfg.HiddenSize, 3)
				dual := deviceRun(t, l, x, T, Dual, Whole)
				if got := deviceRun(t, l, x, T, Auto, Whole); !tc.fuses && !bytes.Equal(got, dual) {
					t.Error("Auto over the limit differs from Dual")
				}
				xb, err := b.dev.Alloc(T * cfg.HiddenSize * 2)
				if err != nil {
					t.Fatal(err)
				}
				defer xb.Free()
				err = l.ForwardDevice(xb, xb, T, FusedShared, Whole)
				if serr := l.MainStream().Synchronize(); serr != nil {
					t.Fatal(serr)
				}
				if !tc.fuses && (err == nil || !errors.Is(err, gpuctx.ErrInvalid) || !strings.Contains(err.Error(), "512")) {
					t.Fatalf("FusedShared over the limit: err = %v, want ErrInvalid naming 512", err)
				}
				if tc.fuses && err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// TestLastRoutingAfterReplay checks that LastRouting reports the last
// forward's routing when that forward was a graph replay: not the routing
// size or slot stride of the last forward that ran eagerly or was captured.
func TestLastRoutingAfterReplay(t *testing.T) {
	cfg := scaledPresets()["deepseek-v2-lite"]
	w, err := RandomWeights(cfg, 29)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range layerBackends(t) {
		for _, tc := range []struct {
			name   string
			mode   Mode // of the forward whose routing is asked for
			other  Mode // of the forwards between
			T, Tot int
		}{{"fused after dual", FusedShared, Dual, 3, 5}, {"dual after fused", Dual, FusedShared, 5, 3}} {
			t.Run(b.name+"/"+tc.name, func(t *testing.T) {
				l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1})
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				x, xo := randomX(tc.T, cfg.HiddenSize, 41), randomX(tc.Tot, cfg.HiddenSize, 42)
				for range 3 { // eager, captured, replayed
					deviceRun(t, l, x, tc.T, tc.mode, Whole)
					deviceRun(t, l, xo, tc.Tot, tc.other, Whole)
				}
				deviceRun(t, l, x, tc.T, tc.mode, Whole) // a replay
				idx, _, err := l.LastRouting()
				if err != nil {
					t.Fatal(err)
				}
				if len(idx) != tc.T*cfg.TopK {
					t.Fatalf("LastRouting has %d indices, want T*K = %d*%d", len(idx), tc.T, cfg.TopK)
				}
				checkRouting(t, l, cfg, roundWeights(w), roundAll(x), tc.T)
			})
		}
	}
}

// TestLayerSortedRowsLimit checks that a fused-path batch whose sorted rows
// (T*(K + the fused shared chunks), padded per expert) pass the MoE kernels'
// 32-bit row indices is refused when it is taken, naming the limit, while the
// same batch in Dual (K slots) gets past that check.
func TestLayerSortedRowsLimit(t *testing.T) {
	cfg := &Config{Family: DeepseekV2, HiddenSize: 8, NumExperts: 16, TopK: 16, Intermediate: 8,
		SharedIntermediate: 8, Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1,
		RoutedScalingFactor: 1, HiddenAct: "silu", MoELayerFreq: 1, DecoderSparseStep: 1}
	w, err := RandomWeights(cfg, 3)
	if err != nil {
		t.Fatal(err)
	}
	// T*16 rows and their padding fit in an int32; T*17 do not.
	bm := moekernels.MaxTileRows()
	T := (math.MaxInt32 - 16*(bm-1) - bm) / 16
	for _, b := range layerBackends(t) {
		l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, NoAutotune: true})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		if l.ns != 1 {
			t.Fatalf("%d fused shared chunks, want 1", l.ns)
		}
		x, err := b.dev.Alloc(64)
		if err != nil {
			t.Fatal(err)
		}
		defer x.Free()
		for _, tc := range []struct {
			mode Mode
			want error
			text string
		}{{FusedShared, gpuctx.ErrInvalid, "sorted rows"}, {Auto, gpuctx.ErrInvalid, "sorted rows"}, {Dual, gpuctx.ErrSize, "holds 64 bytes"}} {
			err := l.ForwardDevice(x, x, T, tc.mode, Whole)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Errorf("%s %v: err = %v, want %v naming %q", b.name, tc.mode, err, tc.want, tc.text)
			}
		}
	}
}
