package moe

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/collective"
)

// cpuDevices opens n CPU-backend runtimes (the CPU backend has one device per
// runtime) and returns their devices.
func cpuDevices(t testing.TB, n int) []*gpuctx.Device {
	t.Helper()
	devs := make([]*gpuctx.Device, n)
	for i := range devs {
		rt, err := gpuctx.OpenBackend("cpu")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rt.Close() })
		if devs[i], err = rt.Device(0); err != nil {
			t.Fatal(err)
		}
	}
	return devs
}

func sameBits(t *testing.T, what string, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	for i := range got {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s: y[%d] = %v (%#08x), one device %v (%#08x): not bitwise equal", what, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
		}
	}
}

// TestExpertParallelMatchesLayer: the N-device output equals the one-device
// Layer.Forward output bitwise in f32 (grouped-GEMM path: T above
// SmallBatchTokens, or the small-batch path off), for N = 2 and 3 with E
// divisible by N or not, and within 2e-2 in bf16 (against Layer's fused path).
func TestExpertParallelMatchesLayer(t *testing.T) {
	parallelHeavy(t)
	presets := scaledPresets()
	names := make([]string, 0, len(presets))
	for name := range presets {
		names = append(names, name)
	}
	sort.Strings(names)
	if raceEnabled || testing.Short() { // CI's race step: every other preset
		for i := 1; i < len(names); i++ {
			names = append(names[:i], names[i+1:]...)
		}
	}
	devs := cpuDevices(t, 3)
	for _, name := range names {
		cfg := presets[name]
		w, err := RandomWeights(cfg, 11)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []int{2, 3} {
			for _, dt := range layerDTypes {
				t.Run(fmt.Sprintf("%s/E=%d/N=%d/%v", name, cfg.NumExperts, n, dt), func(t *testing.T) {
					p, err := NewExpertParallel(devs[:n], cfg, w, dt)
					if err != nil {
						t.Fatal(err)
					}
					defer p.Close()
					for _, tc := range []struct {
						T     int
						small int // the one-device layer's SmallBatchTokens
					}{{37, 0}, {5, -1}, {2, -1}} {
						x := randomX(tc.T, cfg.HiddenSize, uint64(tc.T))
						l, err := NewLayer(devs[0], cfg, w, LayerOptions{DType: dt, Mode: Auto, SmallBatchTokens: tc.small})
						if err != nil {
							t.Fatal(err)
						}
						want, err := l.Forward(x, tc.T)
						_ = l.Close()
						if err != nil {
							t.Fatal(err)
						}
						got, err := p.Forward(x, tc.T)
						if err != nil {
							t.Fatal(err)
						}
						what := fmt.Sprintf("T=%d", tc.T)
						if dt == gpuctx.F32 {
							sameBits(t, what, got, want)
						} else {
							checkClose(t, what, got, want, nil, 2e-2)
						}
					}
				})
			}
		}
	}
}

// TestExpertParallelOneRank: a single rank is the whole layer.
func TestExpertParallelOneRank(t *testing.T) {
	cfg := scaledPresets()["qwen1.5-moe"]
	w, err := RandomWeights(cfg, 5)
	if err != nil {
		t.Fatal(err)
	}
	devs := cpuDevices(t, 1)
	p, err := NewExpertParallel(devs, cfg, w, gpuctx.F32)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if lo, hi := p.Shards()[0].Experts(); lo != 0 || hi != cfg.NumExperts {
		t.Errorf("Experts = %d, %d", lo, hi)
	}
	const T = 20
	x := randomX(T, cfg.HiddenSize, 9)
	l, err := NewLayer(devs[0], cfg, w, LayerOptions{DType: gpuctx.F32})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	want, err := l.Forward(x, T)
	if err != nil {
		t.Fatal(err)
	}
	got, err := p.Forward(x, T)
	if err != nil {
		t.Fatal(err)
	}
	sameBits(t, "N=1", got, want)
}

func TestExpertRanges(t *testing.T) {
	for _, c := range []struct{ E, n int }{{16, 2}, {16, 3}, {12, 5}, {7, 7}} {
		next := 0
		for r := range c.n {
			lo, hi := ExpertRange(c.E, c.n, r)
			if lo != next || hi <= lo {
				t.Errorf("E=%d n=%d: rank %d holds [%d, %d)", c.E, c.n, r, lo, hi)
			}
			next = hi
		}
		if next != c.E {
			t.Errorf("E=%d n=%d: ranges end at %d", c.E, c.n, next)
		}
	}
}

func TestExpertParallelErrors(t *testing.T) {
	cfg := scaledPresets()["qwen1.5-moe"]
	w, err := RandomWeights(cfg, 5)
	if err != nil {
		t.Fatal(err)
	}
	devs := cpuDevices(t, 2)
	if _, err := NewExpertParallel(nil, cfg, w, gpuctx.F32); !errors.Is(err, gpuctx.ErrInvalid) {
		t.Errorf("no devices: %v", err)
	}
	if _, err := NewExpertParallel(devs, cfg, w, gpuctx.F16); !errors.Is(err, gpuctx.ErrInvalid) {
		t.Errorf("f16: %v", err)
	}
	comms, _ := collective.NewLocal(cfg.NumExperts + 1)
	if _, err := NewExpertShard(devs[0], comms[0], cfg, w, gpuctx.F32); !errors.Is(err, gpuctx.ErrInvalid) {
		t.Errorf("more ranks than experts: %v", err)
	}
	p, err := NewExpertParallel(devs, cfg, w, gpuctx.F32)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Forward(make([]float32, 3), 1); !errors.Is(err, gpuctx.ErrSize) {
		t.Errorf("short x: %v", err)
	}
	if _, err := p.Forward(nil, 0); !errors.Is(err, gpuctx.ErrInvalid) {
		t.Errorf("T=0: %v", err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("double Close: %v", err)
	}
	if _, err := p.Forward(make([]float32, cfg.HiddenSize), 1); !errors.Is(err, gpuctx.ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
}
