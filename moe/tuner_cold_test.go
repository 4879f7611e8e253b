package moe

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestTunerColdL2 checks the tuner's L2 flush (openColdL2) on the CPU
// backend given an L2 (coldL2Bytes), with the FP8 layer's tuner
// (tuneAnyBackend), in Dual (the tiles timed) and in Auto (the tiles, then
// Dual's and FusedShared's forwards timed): in the trace of what the device
// ran, every timing comes right after a GEMM of one row by
// coldL2Rows(L2) x coldL2Cols on the main stream (4 per timed candidate: a
// warm-up and three; 1 per timed forward); the flush's buffers are gone
// once the bucket is tuned; the forward after it, tuned, flushes nothing;
// and a device without an L2 is never flushed.
func TestTunerColdL2(t *testing.T) {
	cfg := fp8Configs()["deepseek_v3"] // a fusable shared expert: Auto times its modes
	w := mustRandomWeights(t, cfg, 5)
	const T = 1
	x := randomX(T, cfg.HiddenSize, 3)
	for _, tc := range []struct {
		l2   int
		mode Mode
	}{{0, Dual}, {64 << 10, Dual}, {0, Auto}, {64 << 10, Auto}} {
		l2 := tc.l2
		t.Run(fmt.Sprintf("L2=%d/%v", l2, tc.mode), func(t *testing.T) {
			tuneFP8Anywhere(t, nil)
			var tiles, forwards atomic.Int64
			timingHook = func(forward bool) {
				if forward {
					forwards.Add(1)
				} else {
					tiles.Add(1)
				}
			}
			l := coldTestLayer(t, cfg, w, l2)
			tuning, _ := traceRun(t, l, x, T, tc.mode)
			if tiles.Load() == 0 || (tc.mode == Auto) != (forwards.Load() > 0) {
				t.Fatalf("the first forward timed %d candidates and %d forwards", tiles.Load(), forwards.Load())
			}
			if l.tuner.cold != nil {
				t.Error("the flush's buffers outlived the tuning")
			}
			flushes, followed := countFlushes(tuning, l.main.ID(), l2)
			want := 0
			if l2 > 0 {
				want = 4*int(tiles.Load()) + int(forwards.Load())
			}
			if flushes != want || followed != want {
				t.Errorf("L2 %d bytes: %d flush GEMMs (%d followed by other work on the main stream) for %d candidates and %d forwards timed, want %d",
					l2, flushes, followed, tiles.Load(), forwards.Load(), want)
			}
			tuned, _ := traceRun(t, l, x, T, tc.mode)
			if n, _ := countFlushes(tuned, l.main.ID(), l2); l2 > 0 && n != 0 {
				t.Errorf("the tuned forward flushed L2 %d times", n)
			}
		})
	}
}

// coldTestLayer gives the first backend's device an L2 of l2 bytes
// (coldL2Bytes) for the rest of the test and returns a tuning FP8 layer on
// it, closed at the test's end.
func coldTestLayer(t *testing.T, cfg *Config, w *Weights, l2 int) *Layer {
	t.Helper()
	saved := coldL2Bytes
	coldL2Bytes = func(*gpuctx.Device) int { return l2 }
	t.Cleanup(func() { coldL2Bytes = saved })
	l, err := NewLayer(layerBackends(t)[0].dev, cfg, w, LayerOptions{DType: gpuctx.BF16, FP8: true, NoGraphs: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// traceRun runs one forward of x in mode on l under a tracer and returns
// the trace and the output.
func traceRun(t *testing.T, l *Layer, x []float32, T int, mode Mode) (traceFile, []byte) {
	t.Helper()
	tr := gpuctx.NewTracer()
	if err := l.dev.SetTracer(tr); err != nil {
		t.Fatal(err)
	}
	y := deviceRun(t, l, x, T, mode, Whole)
	if err := l.dev.SetTracer(nil); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := tr.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	_ = tr.Close()
	var tf traceFile
	if err := json.Unmarshal(buf.Bytes(), &tf); err != nil {
		t.Fatal(err)
	}
	return tf, y
}

// countFlushes counts the flush GEMMs for an L2 of l2 bytes among the
// trace's spans on stream tid, and those of them that another span follows.
func countFlushes(tf traceFile, tid uint64, l2 int) (flushes, followed int) {
	isFlush := func(i int) bool {
		e := tf.TraceEvents[i]
		return l2 > 0 && e.Ph == "X" && e.Args["m"] == 1.0 && e.Args["k"] == float64(coldL2Cols) && e.Args["n"] == float64(coldL2Rows(l2))
	}
	var onMain []int
	for i, e := range tf.TraceEvents {
		if e.Ph == "X" && e.Tid != nil && *e.Tid == tid && e.Ts != nil {
			onMain = append(onMain, i)
		}
	}
	slices.SortStableFunc(onMain, func(a, b int) int { return cmp.Compare(*tf.TraceEvents[a].Ts, *tf.TraceEvents[b].Ts) })
	for j, i := range onMain {
		if isFlush(i) {
			flushes++
			if j+1 < len(onMain) && !isFlush(onMain[j+1]) {
				followed++
			}
		}
	}
	return flushes, followed
}

// TestTunerColdL2NoMemory: where the device cannot hold the flush's buffers
// (an L2 of 1 PiB on the CPU backend), the tuning forward still succeeds
// (the device is not left with work queued on freed buffers: the CPU
// backend reports that as a sticky error), times from a warm L2 (no flush
// GEMM in the trace) and says so in TileChoices.
func TestTunerColdL2NoMemory(t *testing.T) {
	cfg := fp8Configs()["deepseek_v3"]
	w := mustRandomWeights(t, cfg, 5)
	const T = 1
	x := randomX(T, cfg.HiddenSize, 3)
	tuneFP8Anywhere(t, nil)
	const l2 = 1 << 50
	l := coldTestLayer(t, cfg, w, l2)
	tuning, _ := traceRun(t, l, x, T, Dual)
	if n, _ := countFlushes(tuning, l.main.ID(), l2); n != 0 {
		t.Errorf("%d flush GEMMs without the flush's buffers", n)
	}
	lines := l.TileChoices()
	if !slices.ContainsFunc(lines, func(s string) bool { return strings.HasPrefix(s, "timed from a warm L2: no memory for the L2 flush") }) {
		t.Errorf("TileChoices %q: want a line saying the tuning timed from a warm L2", lines)
	}
	if l.tuner.cold != nil {
		t.Error("a flush is open after the tuning")
	}
}
