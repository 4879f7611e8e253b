package moe

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/backend/cpu"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// layerBuffers returns the contents of every weight buffer of l, by field name
// (nil for a buffer the layer does not have).
func layerBuffers(t *testing.T, l *Layer) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	for name, b := range map[string]*gpuctx.Buffer{"router": l.router.weight, "bias": l.router.bias, "gu": l.experts.gu, "down": l.experts.down,
		"sgu": l.shared.gu, "sdown": l.shared.down, "sgate": l.shared.gate} {
		if b == nil {
			out[name] = nil
			continue
		}
		h := make([]byte, b.Size())
		if err := b.CopyToHost(h); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = h
	}
	return out
}

// sameLayers fails unless a and b hold bit-identical weight buffers and give
// bit-identical outputs (Single, and FusedShared where the layer fuses the
// shared expert; elsewhere it runs as Dual).
func sameLayers(t *testing.T, a, b *Layer) {
	t.Helper()
	if a.ns != b.ns || a.fusedOK != b.fusedOK {
		t.Fatalf("fused shared chunks %d vs %d, fused path %v vs %v", a.ns, b.ns, a.fusedOK, b.fusedOK)
	}
	ba, bb := layerBuffers(t, a), layerBuffers(t, b)
	for name, va := range ba {
		vb := bb[name]
		if (va == nil) != (vb == nil) || !bytes.Equal(va, vb) {
			i := 0
			for i < min(len(va), len(vb)) && va[i] == vb[i] {
				i++
			}
			t.Errorf("buffer %s differs: %d and %d bytes, first difference at byte %d of element size %d", name, len(va), len(vb), i, a.es)
		}
	}
	for _, T := range []int{1, 5, 40} {
		x := randomX(T, a.cfg.HiddenSize, uint64(T)+7)
		for _, mode := range []Mode{Single, FusedShared} {
			ya, yb := deviceRun(t, a, x, T, mode, Whole), deviceRun(t, b, x, T, mode, Whole)
			if !bytes.Equal(ya, yb) {
				t.Errorf("T=%d %v: outputs differ (relative %.3g)", T, mode, relErr(a.decode(ya), a.decode(yb)))
			}
		}
	}
}

// loadCase is a checkpoint LoadLayer reads: a config variant written in a
// layout and a dtype, over some shards.
type loadCase struct {
	variant string
	layout  Layout
	dt      DType
	shards  int
}

func (c loadCase) String() string {
	return fmt.Sprintf("%s/%s/%s/%dshards", c.variant, [...]string{"per-expert", "fused", "mixtral-hub"}[c.layout], c.dt, c.shards)
}

// writeLayerCheckpoint writes layer 1 of cfg with random weights (and a decoy
// layer 0) in c's layout and dtype to a new directory.
func writeLayerCheckpoint(t *testing.T, cfg *Config, c loadCase) string {
	t.Helper()
	w, err := RandomWeights(cfg, 31)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := LayerTensors(cfg, w, 1, c.layout, c.dt)
	if err != nil {
		t.Fatal(err)
	}
	decoy, _ := RandomWeights(cfg, 32)
	ts0, _ := LayerTensors(cfg, decoy, 0, c.layout, c.dt)
	dir := t.TempDir()
	writeCheckpoint(t, dir, append(ts0, ts...), c.shards)
	return dir
}

// TestLoadLayerMatchesNewLayer checks that LoadLayer builds what NewLayer
// builds from LoadWeights, bit for bit: for every family, in the per-expert,
// fused and Mixtral layouts, from F32, BF16 and F16 files (one file or
// shards), into f32 and bf16 layers, with a shared expert fused into the
// routed kernels (DeepSeek: its width a multiple of the routed width, no
// gate), a Qwen2-MoE shared-expert gate, and no shared expert; with the
// default chunks and with chunks of one row read by three goroutines.
func TestLoadLayerMatchesNewLayer(t *testing.T) {
	var cases []loadCase
	for _, v := range []string{"deepseek_v2_greedy", "deepseek_v3", "qwen2_moe", "qwen3_moe", "mixtral"} {
		for _, dt := range []DType{safetensors.F32, safetensors.BF16, safetensors.F16} {
			cases = append(cases, loadCase{v, PerExpert, dt, 1}, loadCase{v, Fused, dt, 2})
		}
	}
	cases = append(cases, loadCase{"mixtral", MixtralHub, safetensors.BF16, 3}, loadCase{"mixtral", MixtralHub, safetensors.F32, 1},
		loadCase{"deepseek-v2-lite", Fused, safetensors.BF16, 1}, loadCase{"deepseek-v2-lite", PerExpert, safetensors.F32, 3},
		loadCase{"qwen1.5-moe", PerExpert, safetensors.BF16, 1})
	presets := scaledPresets()
	for _, b := range layerBackends(t) {
		for _, c := range cases {
			cfg := variants()[c.variant]
			if cfg == nil {
				cfg = presets[c.variant]
			}
			dir := writeLayerCheckpoint(t, cfg, c)
			w, err := LoadWeights(dir, cfg, 1)
			if err != nil {
				t.Fatal(err)
			}
			for _, dt := range layerDTypes {
				t.Run(b.name+"/"+c.String()+"/"+dt.String(), func(t *testing.T) {
					o := LayerOptions{DType: dt}
					want, err := NewLayer(b.dev, cfg, w, o)
					if err != nil {
						t.Fatal(err)
					}
					defer want.Close()
					if fusable := dt == gpuctx.BF16 && cfg.SharedIntermediate > 0 && !cfg.SharedGate; (want.ns > 0) != fusable {
						t.Fatalf("NewLayer fused %d shared chunks; want some: %v", want.ns, fusable)
					}
					for _, chunks := range []struct {
						name           string
						bytes, workers int
					}{{"default chunks", loadChunkBytes, loadWorkers}, {"row chunks", 1, 3}} {
						t.Run(chunks.name, func(t *testing.T) {
							defer func(b, w int) { loadChunkBytes, loadWorkers = b, w }(loadChunkBytes, loadWorkers)
							loadChunkBytes, loadWorkers = chunks.bytes, chunks.workers
							got, err := LoadLayer(b.dev, dir, cfg, 1, o)
							if err != nil {
								t.Fatal(err)
							}
							defer got.Close()
							sameLayers(t, want, got)
						})
					}
				})
			}
		}
	}
}

// freeBytes returns the device's free memory (the CPU backend counts every
// buffer and host buffer it lends).
func freeBytes(t *testing.T, dev *gpuctx.Device) uint64 {
	t.Helper()
	free, _, err := dev.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	return free
}

// TestLoadLayerErrors: a bad checkpoint, config, layer or option is an error
// naming it, prefixed moe.LoadLayer, and leaves nothing allocated, also when
// it strikes after the buffers were allocated (a file truncated while being
// read, a device out of memory).
func TestLoadLayerErrors(t *testing.T) {
	cfg := variants()["qwen2_moe"]
	v3 := variants()["deepseek_v3"]
	w, _ := RandomWeights(cfg, 1)
	w3, _ := RandomWeights(v3, 1)
	good, err := LayerTensors(cfg, w, 1, PerExpert, safetensors.BF16)
	if err != nil {
		t.Fatal(err)
	}
	good3, _ := LayerTensors(v3, w3, 1, Fused, safetensors.F32)
	p := "model.layers.1.mlp."
	badShape, _ := safetensors.FromFloat32(p+"experts.3.down_proj.weight", safetensors.BF16, []int{8, 16}, make([]float32, 128))
	badDType, _ := safetensors.FromInt32(p+"experts.2.up_proj.weight", []int{8, 16}, make([]int32, 128))
	f64 := safetensors.Tensor{Name: p + "gate.weight", DType: safetensors.F64, Shape: []int{8, 16}, Data: make([]byte, 8*8*16)}
	badFused, _ := safetensors.FromFloat32(p+"experts.gate_up_proj", safetensors.F32, []int{8, 32, 8}, make([]float32, 8*32*8))
	dense := *variants()["deepseek_v2_greedy"]
	dense.FirstKDenseReplace = 2

	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	f32 := LayerOptions{DType: gpuctx.F32}
	type tc struct {
		name    string
		cfg     *Config
		tensors []safetensors.Tensor
		shards  int
		layer   int
		o       LayerOptions
		prepare func(t *testing.T, dir string) // after the checkpoint is written
		hook    func(t *testing.T, dir string) // after the headers were checked
		dev     *gpuctx.Device
		want    []string
	}
	cases := []tc{
		{name: "missing expert", cfg: cfg, tensors: dropTensor(good, p+"experts.5.up_proj.weight"), layer: 1, o: f32,
			want: []string{"moe.LoadLayer layer 1: tensor model.layers.1.mlp.experts.5.up_proj.weight (shape [8 16] expected) is missing from", "model.safetensors"}},
		{name: "missing shared gate", cfg: cfg, tensors: dropTensor(good, p+"shared_expert_gate.weight"), layer: 1, o: f32,
			want: []string{"shared_expert_gate.weight (shape [1 16] expected) is missing"}},
		{name: "missing bias", cfg: v3, tensors: dropTensor(good3, p+"gate.e_score_correction_bias"), layer: 1, o: f32,
			want: []string{"gate.e_score_correction_bias (shape [8] expected) is missing"}},
		{name: "wrong shape", cfg: cfg, tensors: replaceTensor(good, badShape), layer: 1, o: f32,
			want: []string{"experts.3.down_proj.weight has shape [8 16], expected [16 8]", "model.safetensors"}},
		{name: "wrong fused shape", cfg: v3, tensors: replaceTensor(good3, badFused), layer: 1, o: f32,
			want: []string{"experts.gate_up_proj has shape [8 32 8], expected [8 16 16]"}},
		{name: "I32 tensor", cfg: cfg, tensors: replaceTensor(good, badDType), layer: 1, o: f32,
			want: []string{"experts.2.up_proj.weight has dtype I32; want F32, BF16 or F16", "model.safetensors"}},
		{name: "F64 tensor", cfg: cfg, tensors: replaceTensor(good, f64), layer: 1, o: f32,
			want: []string{"gate.weight has dtype F64"}},
		{name: "missing shard", cfg: cfg, tensors: good, shards: 3, layer: 1, o: f32,
			prepare: func(t *testing.T, dir string) { mustRemove(t, filepath.Join(dir, "model-00002-of-00003.safetensors")) },
			want:    []string{"shard model-00002-of-00003.safetensors", "does not exist"}},
		{name: "truncated file", cfg: cfg, tensors: good, layer: 1, o: f32,
			prepare: func(t *testing.T, dir string) { truncateHalf(t, filepath.Join(dir, "model.safetensors")) },
			want:    []string{"moe.LoadLayer layer 1: ", "outside", "model.safetensors"}},
		{name: "truncated while read", cfg: cfg, tensors: good, shards: 2, layer: 1, o: LayerOptions{DType: gpuctx.BF16},
			hook: func(t *testing.T, dir string) {
				truncateHalf(t, filepath.Join(dir, "model-00002-of-00002.safetensors"))
			},
			want: []string{"moe.LoadLayer: ", "model.layers.1.mlp.", "model-00002-of-00002.safetensors", "truncated"}},
		{name: "truncated while converted", cfg: cfg, tensors: good, layer: 1, o: f32,
			hook: func(t *testing.T, dir string) { truncateHalf(t, filepath.Join(dir, "model.safetensors")) },
			want: []string{"moe.LoadLayer: ", "model.safetensors", "truncated"}},
		{name: "wrong layer", cfg: cfg, tensors: good, layer: 0, o: f32, want: []string{"moe.LoadLayer layer 0: tensor model.layers.0.mlp.gate.weight"}},
		{name: "layer out of range", cfg: cfg, tensors: good, layer: 2, o: f32, want: []string{"moe.LoadLayer: layer 2 is out of range"}},
		{name: "dense layer", cfg: &dense, tensors: good, layer: 1, o: f32, want: []string{"moe.LoadLayer: ", "dense MLP layer"}},
		{name: "invalid config", cfg: &Config{Family: Qwen3MoE}, tensors: good, layer: 1, o: f32, want: []string{"moe.LoadLayer: "}},
		{name: "nil config", tensors: good, layer: 1, o: f32, want: []string{"moe.LoadLayer: moe: nil *Config"}},
		{name: "no files", cfg: cfg, layer: 1, o: f32, want: []string{"moe.LoadLayer: no model.safetensors"}},
		{name: "f16 layer", cfg: cfg, tensors: good, layer: 1, o: LayerOptions{DType: gpuctx.F16}, want: []string{"moe.LoadLayer: dtype f16 is not supported"}},
		{name: "bad mode", cfg: cfg, tensors: good, layer: 1, o: LayerOptions{DType: gpuctx.F32, Mode: 9}, want: []string{"moe.LoadLayer: unknown mode"}},
		{name: "bad tile", cfg: cfg, tensors: good, layer: 1, o: LayerOptions{DType: gpuctx.BF16, Tile: "m1n1"}, want: []string{"moe.LoadLayer: LayerOptions.Tile"}},
		{name: "nil device", cfg: cfg, tensors: good, layer: 1, o: f32, dev: nil, want: []string{"moe.LoadLayer: nil device"}},
	}
	for i := range cases {
		if cases[i].name != "nil device" {
			cases[i].dev = dev
		}
	}
	// A device too small for the routed experts: the allocation fails after
	// the router's.
	t.Setenv(cpu.MemoryLimitEnv, "3000")
	small, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	sdev, err := small.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	cases = append(cases, tc{name: "out of memory", cfg: cfg, tensors: good, layer: 1, o: f32, dev: sdev,
		want: []string{"moe.LoadLayer: ", "out of device memory"}})

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			if c.tensors != nil {
				writeCheckpoint(t, dir, c.tensors, c.shards)
			}
			if c.prepare != nil {
				c.prepare(t, dir)
			}
			if c.hook != nil {
				testHookResolved = func() { c.hook(t, dir) }
				defer func() { testHookResolved = nil }()
			}
			var free0 uint64
			if c.dev != nil {
				free0 = freeBytes(t, c.dev)
			}
			l, err := LoadLayer(c.dev, dir, c.cfg, c.layer, c.o)
			if err == nil {
				l.Close()
				t.Fatal("LoadLayer succeeded")
			}
			t.Logf("error: %v", err)
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
			if !strings.HasPrefix(err.Error(), "moe.LoadLayer") {
				t.Errorf("error %q does not start with moe.LoadLayer", err)
			}
			if c.dev != nil {
				if free := freeBytes(t, c.dev); free != free0 {
					t.Errorf("%d bytes of the device leaked", int64(free0)-int64(free))
				}
			}
		})
	}
	if !errors.Is(func() error { _, err := LoadLayer(nil, "", cfg, 1, f32); return err }(), gpuctx.ErrInvalid) {
		t.Error("nil device: the error does not wrap gpuctx.ErrInvalid")
	}
}

func mustRemove(t *testing.T, path string) {
	t.Helper()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
}

// truncateHalf cuts a file to half its size.
func truncateHalf(t *testing.T, path string) {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, st.Size()/2); err != nil {
		t.Fatal(err)
	}
}
