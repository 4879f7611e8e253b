package moe

import (
	"fmt"
	"slices"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// freeInt is freeBytes as an int64, for differences.
func freeInt(t *testing.T, dev *gpuctx.Device) int64 {
	t.Helper()
	return int64(freeBytes(t, dev))
}

// memoryTokens are the batches TestLayerDeviceMemory runs, in order: a shape
// twice (the second run captures a graph where the path allows it), larger
// batches that regrow the scratch (and drop the graphs; 90 tokens run the
// FP8 layers' w8a8 tiles, with their quantized activations), a smaller one
// last. Under -race or -short, fewer.
func memoryTokens() []int {
	if raceEnabled || testing.Short() {
		return []int{3, 3, 90, 7}
	}
	return []int{3, 3, 40, 40, 90, 7}
}

// TestLayerDeviceMemory checks Layer.DeviceMemory against the CPU backend's
// MemInfo, which counts every live device and pinned host allocation: after
// the layer is built and after each forward, free memory has fallen since
// before the layer by exactly DeviceMemory().Total() (plus the caller's main
// stream's BLAS workspace, which the layer does not count), for f32, bf16
// and FP8 layers in every mode they run, with graphs and without; Weights
// is DeviceWeightBytes and holds the FP8 codes and scales; Scratch grows
// with the batch; after Close DeviceMemory is zero and free is back where
// it started.
func TestLayerDeviceMemory(t *testing.T) {
	parallelHeavy(t)
	cfgs := map[string]*Config{"v2lite": scaledPresets()["deepseek-v2-lite"], "v3": fp8Configs()["deepseek_v3"], "qwen3": fp8Configs()["qwen3_moe"]}
	type tc struct {
		cfg    string
		o      LayerOptions
		stream bool // LayerOptions.Stream: a caller's main stream
	}
	var cases []tc
	for _, cfg := range []string{"v2lite", "v3", "qwen3"} {
		for _, m := range []Mode{Single, Dual, FusedShared, Auto} {
			cases = append(cases, tc{cfg, LayerOptions{DType: gpuctx.BF16, Mode: m}, false},
				tc{cfg, LayerOptions{DType: gpuctx.BF16, Mode: m, FP8: true}, false})
			if m != FusedShared {
				cases = append(cases, tc{cfg, LayerOptions{DType: gpuctx.F32, Mode: m}, false})
			}
		}
	}
	cases = append(cases, tc{"v2lite", LayerOptions{DType: gpuctx.BF16, Mode: Dual, NoGraphs: true}, false},
		tc{"v2lite", LayerOptions{DType: gpuctx.BF16, Mode: Dual, NoFused: true}, false},
		tc{"v3", LayerOptions{DType: gpuctx.BF16, Mode: Dual, FP8: true}, true},
		tc{"v3", LayerOptions{DType: gpuctx.F32, Mode: Single}, true})
	weights := map[string]*Weights{}
	for name, cfg := range cfgs {
		w, err := RandomWeights(cfg, 17)
		if err != nil {
			t.Fatal(err)
		}
		weights[name] = w
	}
	for _, c := range cases {
		name := fmt.Sprintf("%s/%v/fp8=%v/%v/nographs=%v/nofused=%v/stream=%v", c.cfg, c.o.DType, c.o.FP8, c.o.Mode, c.o.NoGraphs, c.o.NoFused, c.stream)
		t.Run(name, func(t *testing.T) {
			cfg := cfgs[c.cfg]
			if c.o.Mode == FusedShared && cfg.SharedIntermediate == 0 {
				t.Skip("no shared expert to fuse")
			}
			if (raceEnabled || testing.Short()) && (c.o.Mode == Auto || c.cfg == "qwen3") {
				t.Skip("-race or -short: Auto (which times its modes) and the third config are left out")
			}
			checkLayerMemory(t, cfg, weights[c.cfg], c.o, c.stream)
		})
	}
}

// checkLayerMemory builds a layer of cfg with o on a fresh CPU device (with
// a main stream of the caller's when stream is set), runs memoryTokens()
// through it and checks DeviceMemory against MemInfo (TestLayerDeviceMemory).
func checkLayerMemory(t *testing.T, cfg *Config, w *Weights, o LayerOptions, stream bool) {
	dev := cpuDevices(t, 1)[0]
	var main *gpuctx.Stream
	if stream {
		var err error
		if main, err = dev.NewStream(gpuctx.StreamOptions{}); err != nil {
			t.Fatal(err)
		}
		defer main.Close()
		o.Stream = main
	}
	free0 := freeInt(t, dev)
	l, err := NewLayer(dev, cfg, w, o)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	check := func(when string) MemoryUse {
		t.Helper()
		m := l.DeviceMemory()
		drop := free0 - freeInt(t, dev)
		want := m.Total() + int64(main.WorkspaceBytes()) // the caller's stream: not the layer's
		if drop != want {
			t.Fatalf("%s: free device memory fell by %d bytes; DeviceMemory %+v: Total %d (+ the caller's stream's workspace %d): %d bytes not counted",
				when, drop, m, m.Total(), main.WorkspaceBytes(), drop-want)
		}
		if m.Weights != l.DeviceWeightBytes() || m.PinnedHost <= 0 {
			t.Fatalf("%s: DeviceMemory %+v, DeviceWeightBytes %d", when, m, l.DeviceWeightBytes())
		}
		return m
	}
	m := check("after NewLayer")
	if m.Scratch != 0 || m.BlasWorkspaces != 0 {
		t.Errorf("after NewLayer: scratch %d, workspaces %d; want none before a forward", m.Scratch, m.BlasWorkspaces)
	}
	checkWeightParts(t, l, m)
	var scratch []int64
	tokens := memoryTokens()
	for i, T := range tokens {
		if _, err := l.Forward(randomX(T, cfg.HiddenSize, uint64(i)), T); err != nil {
			t.Fatal(err)
		}
		m := check(fmt.Sprintf("after forward %d (T=%d)", i, T))
		if m.Scratch <= 0 {
			t.Fatalf("T=%d: Scratch = %d", T, m.Scratch)
		}
		scratch = append(scratch, m.Scratch)
	}
	n, big := len(scratch), slices.Index(tokens, 90)
	if !slices.IsSorted(scratch) || scratch[big] <= scratch[big-1] || scratch[n-1] != scratch[n-2] {
		t.Errorf("Scratch after %v tokens: %v; want it to grow with the batch and stay", tokens, scratch)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if m := l.DeviceMemory(); m != (MemoryUse{}) {
		t.Errorf("after Close: DeviceMemory %+v", m)
	}
	if drop := free0 - freeInt(t, dev) - int64(main.WorkspaceBytes()); drop != 0 {
		t.Errorf("after Close: %d bytes not returned", drop)
	}
}

// checkWeightParts checks the FP8 parts of Weights against the sizes of the
// routed experts and fused shared chunks (fp8Sizes); none in bf16 and f32.
func checkWeightParts(t *testing.T, l *Layer, m MemoryUse) {
	t.Helper()
	if !l.FP8() {
		if m.FP8Codes != 0 || m.FP8Scales != 0 {
			t.Errorf("%v layer: FP8 codes %d, scales %d", l.DType(), m.FP8Codes, m.FP8Scales)
		}
		return
	}
	sz := fp8Sizes(&l.cfg, l.cfg.NumExperts+l.ns)
	if m.FP8Codes != int64(sz[0]+sz[2]) || m.FP8Scales != int64(sz[1]+sz[3]) || m.FP8Codes+m.FP8Scales >= m.Weights {
		t.Errorf("FP8 layer: codes %d, scales %d of weights %d; want %d and %d", m.FP8Codes, m.FP8Scales, m.Weights, sz[0]+sz[2], sz[1]+sz[3])
	}
}

// TestExpertShardDeviceMemory checks ExpertShard.DeviceMemory against each
// rank's MemInfo as TestLayerDeviceMemory does, over two forwards (the
// second regrows) and Close.
func TestExpertShardDeviceMemory(t *testing.T) {
	cfg := scaledPresets()["deepseek-v2-lite"]
	w, err := RandomWeights(cfg, 5)
	if err != nil {
		t.Fatal(err)
	}
	devs := cpuDevices(t, 2)
	free0 := []int64{freeInt(t, devs[0]), freeInt(t, devs[1])}
	p, err := NewExpertParallel(devs, cfg, w, gpuctx.BF16)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	check := func(when string) {
		t.Helper()
		for r, s := range p.Shards() {
			m := s.DeviceMemory()
			if drop := free0[r] - freeInt(t, devs[r]); drop != m.Total() {
				t.Fatalf("%s: rank %d: free fell by %d, DeviceMemory %+v totals %d", when, r, drop, m, m.Total())
			}
		}
	}
	check("after NewExpertParallel")
	for _, T := range []int{5, 60} {
		if _, err := p.Forward(randomX(T, cfg.HiddenSize, 1), T); err != nil {
			t.Fatal(err)
		}
		check(fmt.Sprintf("after T=%d", T))
	}
	shards := p.Shards()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	for r, s := range shards {
		if m := s.DeviceMemory(); m != (MemoryUse{}) || freeInt(t, devs[r]) != free0[r] {
			t.Errorf("after Close: rank %d: DeviceMemory %+v, free %d of %d", r, m, freeInt(t, devs[r]), free0[r])
		}
	}
}
