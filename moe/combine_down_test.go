package moe

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// tracedKernels runs f with a Tracer on dev and returns the names of the
// gpuctx_moe_* kernels it traced (queued outside a graph capture), or nil
// when the backend cannot trace.
func tracedKernels(t *testing.T, dev *gpuctx.Device, f func()) map[string]bool {
	t.Helper()
	tr := gpuctx.NewTracer()
	if err := dev.SetTracer(tr); err != nil {
		t.Logf("no tracer on %s: %v", dev.Info().Name, firstLine(err))
		return nil
	}
	f()
	if err := dev.SetTracer(nil); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := tr.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	var tf traceFile
	if err := json.Unmarshal(buf.Bytes(), &tf); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, e := range tf.TraceEvents {
		if e.Ph == "X" && strings.HasPrefix(e.Name, "gpuctx_moe_") {
			names[e.Name] = true
		}
	}
	return names
}

// hasDownCombine reports whether names holds a down kernel with the row
// combine (gpuctx_moe_downc_<tile>).
func hasDownCombine(names map[string]bool) bool {
	for n := range names {
		if strings.HasPrefix(n, "gpuctx_moe_downc_") {
			return true
		}
	}
	return false
}

// TestCombineInDown checks the fused path's down kernel with the row combine
// (gpuctx_moe_downc_<tile>, combineInDown): on every backend, for FusedShared,
// a layer without a shared expert and the routed part alone, several forced
// mma.sync tiles and the rule's, and T in 1..64, the layer's y is bitwise the
// y of the same layer with LayerOptions.SeparateCombine; the first forward of
// each T (eager, traced) runs the downc kernel and no
// gpuctx_moe_combine_rows. At T = 65 (above combineInDownTokens) and in Dual
// mode (the shared expert is added by the combine) both layers run
// gpuctx_moe_combine_rows and still agree. Every T runs four forwards that
// alternate two inputs, eager, captured and replayed: a counter that a launch
// leaves non-zero makes a later forward leave rows of y unwritten (CUDA) or
// fail (the CPU twin checks the counters).
func TestCombineInDown(t *testing.T) {
	presets := scaledPresets()
	cases := []struct {
		name, preset string
		mode         Mode
		part         Part
		inDown       bool // the layer may combine in the down kernel (T <= combineInDownTokens)
	}{
		{"fused-shared", "deepseek-v2-lite", FusedShared, Whole, true},
		{"no-shared-expert", "qwen3-30b-a3b", Single, Whole, true},
		{"routed-only", "deepseek-v2-lite", Single, RoutedOnly, true},
		{"dual", "deepseek-v2-lite", Dual, Whole, false}, // the shared expert's rows are added by combine_rows
	}
	tiles := []string{"m16n16k64w1x1s8", "m16n32k256w1x2s3", "m32n128k64w1x8s4", "m64n64k64w2x2s4", "m128n64k64w2x2s3", ""} // "": the rule's tile
	for _, b := range layerBackends(t) {
		for _, tc := range cases {
			cfg := presets[tc.preset]
			w, err := RandomWeights(cfg, 29)
			if err != nil {
				t.Fatal(err)
			}
			for _, tile := range tiles {
				name := tile
				if name == "" {
					name = "rule"
				}
				t.Run(fmt.Sprintf("%s/%s/%s", b.name, tc.name, name), func(t *testing.T) {
					o := LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1, Tile: tile, NoAutotune: tile == ""}
					l, err := NewLayer(b.dev, cfg, w, o)
					if err != nil {
						t.Fatal(err)
					}
					defer l.Close()
					o.SeparateCombine = true
					sep, err := NewLayer(b.dev, cfg, w, o)
					if err != nil {
						t.Fatal(err)
					}
					defer sep.Close()
					if tc.mode == FusedShared && l.ns == 0 {
						t.Fatal("the shared expert cannot be fused: the case tests nothing")
					}
					for _, T := range []int{1, 3, 8, 16, 64, 65} {
						xs := [2][]float32{randomX(T, cfg.HiddenSize, uint64(T)+70), randomX(T, cfg.HiddenSize, uint64(T)+71)}
						var want [2][]byte
						for i, x := range xs {
							want[i] = deviceRun(t, sep, x, T, tc.mode, tc.part)
							if bytes.Contains(want[i], []byte{0xff, 0xff}) {
								t.Fatalf("T=%d: SeparateCombine left y elements unwritten", T)
							}
						}
						if bytes.Equal(want[0], want[1]) {
							t.Fatalf("T=%d: the two inputs give the same y: a stale y would pass", T)
						}
						for run := range 4 { // eager, then captured, then replayed
							i := run % 2
							var got []byte
							names := map[string]bool{}
							if run == 0 {
								names = tracedKernels(t, b.dev, func() { got = deviceRun(t, l, xs[i], T, tc.mode, tc.part) })
							} else {
								got = deviceRun(t, l, xs[i], T, tc.mode, tc.part)
							}
							if !bytes.Equal(got, want[i]) {
								t.Fatalf("T=%d run %d: y differs from SeparateCombine's (relative %.3g)", T, run, relErr(l.decode(got), l.decode(want[i])))
							}
							if names == nil || run > 0 {
								continue
							}
							inDown := tc.inDown && T <= combineInDownTokens
							if hasDownCombine(names) != inDown || names["gpuctx_moe_combine_rows"] == inDown {
								t.Fatalf("T=%d: kernels %v; want the down kernel with the row combine %v, gpuctx_moe_combine_rows %v",
									T, names, inDown, !inDown)
							}
						}
					}
					if len(l.graphs)+len(l.direct) == 0 && b.name == "cpu" {
						t.Fatal("no forward was captured into a graph")
					}
					if l.downc.k != nil {
						t.Fatal("a down kernel with the row combine was left unqueued")
					}
				})
			}
		}
	}
}

// TestCombineInDownRule checks when the layer combines in the down kernel:
// bf16 mma.sync tiles, at most combineInDownTokens tokens, no shared term to
// add, and not SeparateCombine.
func TestCombineInDownRule(t *testing.T) {
	mma, err := parseTile("m16n64k64w1x4s6")
	if err != nil {
		t.Fatal(err)
	}
	wg, err := parseTile("m128n128k64g2s4")
	if err != nil {
		t.Fatal(err)
	}
	bf := &Layer{dt: gpuctx.BF16}
	for _, tc := range []struct {
		l      *Layer
		T      int
		shared int
		want   bool
		tile   string
	}{
		{bf, 1, sharedNone, true, "mma"},
		{bf, combineInDownTokens, sharedFused, true, "mma"},
		{bf, combineInDownTokens + 1, sharedNone, false, "mma"},
		{bf, 8, sharedSide, false, "mma"},
		{bf, 8, sharedMain, false, "mma"},
		{bf, 8, sharedNone, false, "wg"},
		{&Layer{dt: gpuctx.BF16, sepCombine: true}, 8, sharedNone, false, "mma"},
		{&Layer{dt: gpuctx.F32}, 8, sharedNone, false, "mma"},
	} {
		c := mma
		if tc.tile == "wg" {
			c = wg
		}
		if got := tc.l.combineInDown(tc.T, tc.shared, c); got != tc.want {
			t.Errorf("combineInDown(T=%d, shared=%d, %s) with dtype %v, SeparateCombine %v = %v, want %v",
				tc.T, tc.shared, c.Tag(), tc.l.dt, tc.l.sepCombine, got, tc.want)
		}
	}
}
