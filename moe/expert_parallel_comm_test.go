package moe

import (
	"errors"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/collective"
)

// TestExpertParallelComms: a layer over communicators the caller made gives
// NewExpertParallel's output bitwise (f32), and bad communicators are refused
// with ErrInvalid, every comm closed.
func TestExpertParallelComms(t *testing.T) {
	cfg := scaledPresets()["qwen1.5-moe"]
	w, err := RandomWeights(cfg, 5)
	if err != nil {
		t.Fatal(err)
	}
	devs := cpuDevices(t, 2)
	const T = 24
	x := randomX(T, cfg.HiddenSize, 3)
	ref, err := NewExpertParallel(devs, cfg, w, gpuctx.F32)
	if err != nil {
		t.Fatal(err)
	}
	want, err := ref.Forward(x, T)
	_ = ref.Close()
	if err != nil {
		t.Fatal(err)
	}
	comms, err := collective.NewLocal(2)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewExpertParallelComms(devs, []collective.Comm{comms[0], comms[1]}, cfg, w, gpuctx.F32)
	if err != nil {
		t.Fatal(err)
	}
	got, err := p.Forward(x, T)
	if err := p.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	sameBits(t, "comms", got, want)

	for _, tc := range []struct {
		name  string
		devs  []*gpuctx.Device
		comms func() []collective.Comm
	}{
		{"no devices", nil, func() []collective.Comm { return nil }},
		{"fewer comms", devs, func() []collective.Comm { c, _ := collective.NewLocal(1); return []collective.Comm{c[0]} }},
		{"ranks swapped", devs, func() []collective.Comm { c, _ := collective.NewLocal(2); return []collective.Comm{c[1], c[0]} }},
		{"nil comm", devs, func() []collective.Comm { c, _ := collective.NewLocal(2); return []collective.Comm{c[0], nil} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := tc.comms()
			if _, err := NewExpertParallelComms(tc.devs, cs, cfg, w, gpuctx.F32); !errors.Is(err, gpuctx.ErrInvalid) {
				t.Fatalf("err %v, want ErrInvalid", err)
			}
			for r, c := range cs {
				if c == nil {
					continue
				}
				if _, err := c.AllGather([]int{1}); !errors.Is(err, gpuctx.ErrClosed) {
					t.Errorf("comm %d not closed: %v", r, err)
				}
			}
		})
	}
}
