package bench

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe"
)

// countSteps counts Progress steps.
type countSteps struct{ total, steps int }

func (c *countSteps) Begin(total int, _ string) { c.total = total }
func (c *countSteps) Step(string)               { c.steps++ }
func (c *countSteps) End()                      {}

// smallBench returns the options of a bench of a scaled-down DeepSeek-V2-Lite
// layer on the CPU backend.
func smallBench(t *testing.T) (*gpuctx.Device, MoEOptions) {
	t.Helper()
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close() })
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	full, err := moe.Preset("deepseek-v2-lite")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := ScaleDown(full)
	if err != nil {
		t.Fatal(err)
	}
	return dev, MoEOptions{Config: cfg, Modes: []moe.Mode{moe.Single, moe.Dual}, Tokens: []int{1, 5}, Iters: 2, Warmup: 0, Sets: 3, Seed: 1,
		CopyBytes: 1 << 20, GemmN: 64, GemmPerRound: 1, CheckTol: CheckTol(gpuctx.BF16),
		Layer:   moe.LayerOptions{DType: gpuctx.BF16, NoAutotune: true},
		Weights: func(s int) (*moe.Weights, error) { return moe.RandomWeightsDist(cfg, 1+uint64(s), moe.InitNormal) }}
}

// TestMoEBenchRounds runs two rounds on the CPU backend: every set gets a
// layer, every row is complete and checked, the progress count is exact, and
// an output check with a tolerance nothing can meet fails the pass.
func TestMoEBenchRounds(t *testing.T) {
	cases := []struct {
		name    string
		tol     float64
		wantErr string
	}{
		{"checked", CheckTol(gpuctx.BF16), ""},
		{"check fails", -1, "output check: the single forward of 1 tokens (weight set 0) differs"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dev, o := smallBench(t)
			o.CheckTol = c.tol
			pr := &countSteps{}
			o.Progress = pr
			free0 := freeBytes(t, dev)
			b, err := NewMoEBench(dev, o)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			if len(b.layers) != 3 {
				t.Fatalf("%d layers, want one per set (3)", len(b.layers))
			}
			rep := &MoEReport{}
			_, err = b.RunRounds(context.Background(), nil, 2, rep)
			var be *Error
			if c.wantErr != "" {
				if err == nil || !errors.As(err, &be) || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err %v, want %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			checkBenchMemory(t, b, rep, free0-freeBytes(t, dev))
			if want := MoESteps(o, 2, false); pr.steps != want {
				t.Errorf("%d progress steps, MoESteps says %d", pr.steps, want)
			}
			if len(b.Passes()) != 2 || len(rep.Rows) != 2 {
				t.Fatalf("%d passes, %d rows", len(b.Passes()), len(rep.Rows))
			}
			for _, r := range rep.Rows {
				if r.MedianUS["single"] <= 0 || r.MedianUS["dual"] <= 0 || r.SharedUS == nil || r.RoutedUS <= 0 ||
					r.ActiveExperts < 1 || r.ActiveExperts > float64(min(r.Tokens*o.Config.TopK, o.Config.NumExperts)) || r.WeightBytes <= 0 || !(r.FloorUS > 0) {
					t.Errorf("row incomplete: %+v", r)
				}
				if e, ok := r.CheckRelErr["dual"]; !ok || e > o.CheckTol {
					t.Errorf("T=%d: dual check %v (ran %v)", r.Tokens, e, ok)
				}
			}
		})
	}
}

// freeBytes returns dev's free memory (MemInfo).
func freeBytes(t *testing.T, dev *gpuctx.Device) int64 {
	t.Helper()
	free, _, err := dev.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	return int64(free)
}

// checkBenchMemory checks rep's device memory after the rounds: weight set
// 0's layer's DeviceMemory (its scratch grown by the largest batch) and the
// main stream's workspace, as a field and a note; and, on the CPU backend,
// that the layers' totals and the main stream's workspace are what the bench
// took from MemInfo's free bytes (drop: since before NewMoEBench).
func checkBenchMemory(t *testing.T, b *MoEBench, rep *MoEReport, drop int64) {
	t.Helper()
	m := rep.Memory
	if m == nil {
		t.Fatal("no device memory in the report")
	}
	want := MoEMemory{LayerMemory: NewLayerMemory(b.layers[0].DeviceMemory()), Tokens: 5, MainStreamWorkspace: int64(b.main.WorkspaceBytes())}
	if *m != want || m.Scratch <= 0 || m.Weights <= 0 || m.TotalBytes != m.Weights+m.Scratch+m.BlasWorkspaces+m.PinnedHost {
		t.Errorf("report's device memory %+v, the layer's %+v", *m, want)
	}
	note := "device memory per layer (weight set 0) after the largest batch (5 tokens): " + m.Text()
	if !slices.ContainsFunc(rep.Notes, func(n string) bool { return strings.HasPrefix(n, note) }) {
		t.Errorf("no note %q in %q", note, rep.Notes)
	}
	sum := m.MainStreamWorkspace
	for _, l := range b.layers {
		sum += l.DeviceMemory().Total()
	}
	if drop != sum {
		t.Errorf("free device memory fell by %d bytes; the layers' DeviceMemory and the main stream's workspace total %d", drop, sum)
	}
}

// TestMoEBenchCheck: the output check reads every set's timed output (the
// rotation reaches every set) and fails, naming the set, when one differs
// from its reference.
func TestMoEBenchCheck(t *testing.T) {
	dev, o := smallBench(t)
	b, err := NewMoEBench(dev, o)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	r, err := b.newTokenRun(3)
	if err != nil {
		t.Fatal(err)
	}
	defer r.free()
	if _, err := b.variant(r, "single", moe.Single, moe.Whole); err != nil {
		t.Fatal(err)
	}
	if e, err := b.check(r, moe.Single); err != nil || e != 0 {
		t.Fatalf("single against the single-stream reference: %v, %v (want 0: the same forward)", e, err)
	}
	for i := range r.refHost[2] { // set 2's reference replaced
		r.refHost[2][i] = 0
	}
	copy(r.refHost[2], Encode([]float32{1, 2, 3, 4}, gpuctx.BF16))
	_, err = b.check(r, moe.Single)
	if err == nil || !strings.Contains(err.Error(), "weight set 2") {
		t.Fatalf("a wrong output in set 2: err %v", err)
	}
}
