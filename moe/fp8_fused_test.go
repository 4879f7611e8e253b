package moe

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/fp8"
)

// fp8FusedConfigs are fp8Configs and one layer whose routed width is a
// multiple of 128 (I = 128, a shared expert of two chunks), where every
// chunk of the shared expert keeps the codes and scales of the whole
// (fp8Chunk); in fp8Configs (I = 160) DeepSeek-V2's second chunk is
// requantized.
func fp8FusedConfigs() map[string]*Config {
	cfgs := fp8Configs()
	c := *cfgs["deepseek_v2_greedy"]
	c.Intermediate, c.SharedIntermediate = 128, 256
	cfgs["deepseek_v2_i128"] = &c
	return cfgs
}

// fp8Quantized quantizes v (rows x cols) in 128x128 blocks.
func fp8Quantized(t *testing.T, v []float32, rows, cols int) *fp8.Weight {
	t.Helper()
	q, err := fp8.Quantize(v, rows, cols, [2]int{fp8.BlockSize, fp8.BlockSize})
	if err != nil {
		t.Fatal(err)
	}
	return q
}

// fp8SharedChunked returns the shared expert an FP8 layer's FusedShared
// computes with, from the shared expert's gate, up and down projections in
// FP8: each cut into ns chunks of the routed width as uploadShared cuts them
// (fp8Chunk), dequantized, and put back together ([Is][H] and [H][Is]).
func fp8SharedChunked(t *testing.T, cfg *Config, ns int, g, u, d *fp8.Weight) *Expert {
	t.Helper()
	H, I, Is := cfg.HiddenSize, cfg.Intermediate, cfg.SharedIntermediate
	sh := &Expert{Gate: make([]float32, Is*H), Up: make([]float32, Is*H), Down: make([]float32, H*Is)}
	deq := func(w *fp8.Weight, r0, r1, c0, c1 int) []float32 {
		c, err := fp8Chunk(w, r0, r1, c0, c1)
		if err != nil {
			t.Fatal(err)
		}
		v, err := c.Dequantize()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for j := range ns {
		copy(sh.Gate[j*I*H:], deq(g, j*I, (j+1)*I, 0, H))
		copy(sh.Up[j*I*H:], deq(u, j*I, (j+1)*I, 0, H))
		v := deq(d, 0, H, j*I, (j+1)*I)
		for h := range H {
			copy(sh.Down[h*Is+j*I:][:I], v[h*I:][:I])
		}
	}
	return sh
}

// fp8DequantizedFused is fp8Dequantized with, where the layer fuses the
// shared expert in ns > 0 chunks, the shared expert its FusedShared forward
// computes with (quantized whole from w, then cut: fp8SharedChunked).
func fp8DequantizedFused(t *testing.T, cfg *Config, w *Weights, ns int) *Weights {
	t.Helper()
	out := fp8Dequantized(t, cfg, w)
	if ns > 0 {
		H, Is := cfg.HiddenSize, cfg.SharedIntermediate
		out.Shared = fp8SharedChunked(t, cfg, ns, fp8Quantized(t, w.Shared.Gate, Is, H),
			fp8Quantized(t, w.Shared.Up, Is, H), fp8Quantized(t, w.Shared.Down, H, Is))
	}
	return out
}

// TestFP8Chunk checks fp8Chunk: a cut on block edges keeps the codes and
// scales (the same real weights, bit for bit), any other cut is the cut's
// dequantized weights quantized again in 128x128 blocks.
func TestFP8Chunk(t *testing.T) {
	const rows, cols = 320, 144
	v := randomX(rows, cols, 7)
	w := fp8Quantized(t, v, rows, cols)
	full, err := w.Dequantize()
	if err != nil {
		t.Fatal(err)
	}
	sub := func(r0, r1, c0, c1 int) []float32 {
		var out []float32
		for r := r0; r < r1; r++ {
			out = append(out, full[r*cols+c0:r*cols+c1]...)
		}
		return out
	}
	for _, c := range []struct {
		r0, r1, c0, c1 int
		exact          bool
	}{
		{0, 160, 0, cols, true}, {128, 256, 0, cols, true}, {256, 320, 0, cols, true},
		{0, rows, 128, 144, true}, {0, 128, 0, 16, true},
		{160, 320, 0, cols, false}, {0, rows, 16, 144, false}, {64, 192, 32, 96, false},
	} {
		t.Run(fmt.Sprintf("rows%d-%d/cols%d-%d", c.r0, c.r1, c.c0, c.c1), func(t *testing.T) {
			got, err := fp8Chunk(w, c.r0, c.r1, c.c0, c.c1)
			if err != nil {
				t.Fatal(err)
			}
			if err := got.Check(); err != nil {
				t.Fatal(err)
			}
			want := sub(c.r0, c.r1, c.c0, c.c1)
			if !c.exact {
				q := fp8Quantized(t, want, c.r1-c.r0, c.c1-c.c0)
				if !bytes.Equal(got.Codes, q.Codes) || !slices.Equal(got.Scales, q.Scales) {
					t.Fatal("the requantized chunk is not fp8.Quantize of its dequantized weights")
				}
				return
			}
			d, err := got.Dequantize()
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(d, want) {
				t.Error("a chunk cut on block edges changed its real weights")
			}
			for r := c.r0; r < c.r1; r++ {
				if !bytes.Equal(got.Codes[(r-c.r0)*(c.c1-c.c0):][:c.c1-c.c0], w.Codes[r*cols+c.c0:r*cols+c.c1]) {
					t.Fatalf("row %d: the codes changed", r)
				}
			}
		})
	}
}

// TestLayerFP8FusedShared checks FusedShared on FP8 layers: where the shared
// expert can be fused (no shared gate, a multiple of the routed width) its
// chunks run in FP8 in the w8a16 tiles (never the w8a8 ones), within 1e-2
// relative of the float64 reference on the weights they hold
// (fp8DequantizedFused), with Dual's routing; the captured graph's replays
// are bitwise the eager forward, the up blocks of the chunks that start
// before the sort ends give the bits of ones that wait (plan.early = 0), and
// FusedShared differs from Single by the shared expert's FP8 rounding only.
// Elsewhere (a shared gate, no shared expert) FusedShared is Dual, bit for
// bit.
func TestLayerFP8FusedShared(t *testing.T) {
	parallelHeavy(t)
	for _, b := range layerBackends(t) {
		for name, cfg := range fp8FusedConfigs() {
			w, err := RandomWeights(cfg, 13)
			if err != nil {
				t.Fatal(err)
			}
			t.Run(b.name+"/"+name, func(t *testing.T) {
				layer := func(o LayerOptions, change func(*plan)) (*Layer, *planRecorder) {
					o.DType, o.FP8 = gpuctx.BF16, true
					l, err := NewLayer(b.dev, cfg, w, o)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { l.Close() })
					return l, recordPlans(l, change)
				}
				l, rec := layer(LayerOptions{}, nil)
				eager, _ := layer(LayerOptions{NoGraphs: true}, nil)
				waits, _ := layer(LayerOptions{NoGraphs: true}, func(p *plan) { p.early = 0 })
				fusable := cfg.SharedIntermediate > 0 && !cfg.SharedGate
				if got := l.ns > 0; got != fusable {
					t.Fatalf("shared expert fused = %v (%d chunks), want %v", got, l.ns, fusable)
				}
				wq := fp8DequantizedFused(t, cfg, w, l.ns)
				// Under -race or -short the 16-row and 32-row tiles; the plain
				// run adds a batch that Dual runs in the w8a8 tiles.
				for _, T := range heavyShapes([]int{1, 7, 40, 200}, []int{1, 7, 40}) {
					x := randomX(T, cfg.HiddenSize, uint64(T)+90)
					dual := deviceRun(t, l, x, T, Dual, Whole)
					dualIdx, _, err := l.LastRouting()
					if err != nil {
						t.Fatal(err)
					}
					fused := deviceRun(t, l, x, T, FusedShared, Whole)
					p := rec.last
					if p.fusedShared() != fusable || (fusable && (p.fp8.w8 || p.ks-cfg.TopK != l.ns)) {
						t.Fatalf("T=%d: fused shared %v with %d chunks in the sort, w8a8 %v; want %v, %d, false", T, p.fusedShared(), p.ks-cfg.TopK, p.fp8.w8, fusable, l.ns)
					}
					idx, _, err := l.LastRouting()
					if err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(idx, dualIdx) {
						t.Errorf("T=%d: FusedShared routed differently from Dual", T)
					}
					for run := range 2 { // graph capture, then replay
						if again := deviceRun(t, l, x, T, FusedShared, Whole); !bytes.Equal(again, fused) {
							t.Fatalf("T=%d run %d: FusedShared is not reproducible", T, run)
						}
					}
					// The three layers tune apart; where two candidates of
					// different families (w8a16, w8a8) time alike their picks
					// may differ, and with them the bits. The graph-or-eager and
					// early-rows comparisons are about the same tiles: eager and
					// waits take l's.
					shareTiles(l, eager, waits)
					if got := deviceRun(t, eager, x, T, FusedShared, Whole); !bytes.Equal(got, fused) {
						t.Errorf("T=%d: the graph layer differs from the eager one (relative %.3g)", T, relErr(l.decode(fused), l.decode(got)))
					}
					if got := deviceRun(t, waits, x, T, FusedShared, Whole); !bytes.Equal(got, fused) {
						t.Errorf("T=%d: the early shared rows differ from the sorted ones (relative %.3g)", T, relErr(l.decode(fused), l.decode(got)))
					}
					if !fusable {
						if !bytes.Equal(fused, dual) {
							t.Errorf("T=%d: FusedShared fell back but differs from Dual", T)
						}
						continue
					}
					want, err := Reference(cfg, wq, roundAll(x), T)
					if err != nil {
						t.Fatal(err)
					}
					y := l.decode(fused)
					rel := relErr(y, want)
					relSingle := relErr(y, l.decode(deviceRun(t, l, x, T, Single, Whole)))
					t.Logf("T=%d: relative error %.3g against the reference, %.3g against Single (bf16 shared expert)", T, rel, relSingle)
					if !(rel <= 1e-2) {
						t.Errorf("T=%d: relative error %.3g against the float64 reference on the dequantized weights, want <= 1e-2", T, rel)
					}
					if !(relSingle <= 8e-2) {
						t.Errorf("T=%d: FusedShared differs from Single by %.3g relative, want <= 8e-2 (the shared expert's FP8 rounding)", T, relSingle)
					}
					routed := l.decode(deviceRun(t, l, x, T, FusedShared, RoutedOnly))
					if rel := relErr(routed, y); !(rel > 1e-2) {
						t.Errorf("T=%d: routed alone equals FusedShared whole (%.3g): the shared expert is missing", T, rel)
					}
				}
			})
		}
	}
}

// shareTiles gives each layer of to the tiles that from has chosen so far
// (its own choices for those buckets are replaced; the others stay).
func shareTiles(from *Layer, to ...*Layer) {
	for _, l := range to {
		maps.Copy(l.tuner.fp8, from.tuner.fp8)
		maps.Copy(l.tuner.tiles, from.tuner.tiles)
	}
}
