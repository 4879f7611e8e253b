package moe

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"sync"

	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// DType is the on-disk element type of a weight tensor.
type DType = safetensors.DType

// Expert holds one SwiGLU MLP, y = Down(silu(Gate x) * (Up x)), in the nn.Linear
// layout of the checkpoint: row-major [out][in].
type Expert struct {
	// Gate and Up are [I][H]: row i holds the weights of intermediate unit i.
	Gate, Up []float32
	// Down is [H][I].
	Down []float32
}

// Weights is one MoE layer's weights on the host, stored as float32 whatever the
// file's dtype (BF16 and F16 widen exactly). It is plain data: safe to read from
// many goroutines; nothing here is on a device.
type Weights struct {
	// Router is the gate, [E][H].
	Router []float32
	// Bias is the e_score_correction_bias [E] (noaux_tc only), else nil. It is
	// used for selection only, never as a weight.
	Bias []float32
	// Experts are the E routed experts, each with intermediate width I.
	Experts []Expert
	// Shared is the shared expert (width Config.SharedIntermediate), or nil.
	Shared *Expert
	// SharedGate is the Qwen2-MoE shared_expert_gate row [H], or nil.
	SharedGate []float32
	// DType is the on-disk dtype of the routed expert weights (F32 for
	// RandomWeights). When it is BF16 every expert value is exactly a bfloat16, so
	// ToBF16 gives back the file's bits with no second rounding.
	DType DType
	// DTypes records the on-disk dtype of every tensor read, keyed by its name
	// relative to the layer prefix (for example "gate.weight" or
	// "experts.gate_up_proj"). Nil for RandomWeights.
	DTypes map[string]DType
}

// ToBF16 converts float32 values to bfloat16 bits, rounding to nearest even. For
// weights loaded from a BF16 file (Weights.DType == BF16) the conversion is exact:
// the result is bit-identical to the file.
func ToBF16(src []float32) []uint16 {
	out := make([]uint16, len(src))
	for i, v := range src {
		out[i] = safetensors.Float32ToBF16(v)
	}
	return out
}

// Check verifies that w has every tensor cfg needs, with the right lengths. It
// returns an error naming the first missing or misshaped tensor.
func (w *Weights) Check(cfg *Config) error {
	if w == nil {
		return errors.New("moe: nil *Weights")
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	H, E, I := cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate
	if len(w.Router) != E*H {
		return fmt.Errorf("moe: router has %d values, want [%d,%d] = %d", len(w.Router), E, H, E*H)
	}
	if cfg.HasBias() != (w.Bias != nil) || (w.Bias != nil && len(w.Bias) != E) {
		return fmt.Errorf("moe: correction bias has %d values (nil=%v); %s with %s wants %d", len(w.Bias), w.Bias == nil, cfg.Family, cfg.TopKMethod, boolInt(cfg.HasBias())*E)
	}
	if len(w.Experts) != E {
		return fmt.Errorf("moe: %d experts, want %d", len(w.Experts), E)
	}
	for e := range w.Experts {
		if err := checkExpert(&w.Experts[e], H, I); err != nil {
			return fmt.Errorf("moe: expert %d: %w", e, err)
		}
	}
	if (cfg.SharedIntermediate > 0) != (w.Shared != nil) {
		return fmt.Errorf("moe: shared expert present=%v, but the config's shared intermediate size is %d", w.Shared != nil, cfg.SharedIntermediate)
	}
	if w.Shared != nil {
		if err := checkExpert(w.Shared, H, cfg.SharedIntermediate); err != nil {
			return fmt.Errorf("moe: shared expert: %w", err)
		}
	}
	if cfg.SharedGate != (w.SharedGate != nil) || (w.SharedGate != nil && len(w.SharedGate) != H) {
		return fmt.Errorf("moe: shared expert gate has %d values (nil=%v); config wants %d", len(w.SharedGate), w.SharedGate == nil, boolInt(cfg.SharedGate)*H)
	}
	return nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func checkExpert(x *Expert, H, I int) error {
	if len(x.Gate) != I*H || len(x.Up) != I*H || len(x.Down) != H*I {
		return fmt.Errorf("gate/up/down have %d/%d/%d values, want %d each ([%d,%d], [%d,%d], [%d,%d])",
			len(x.Gate), len(x.Up), len(x.Down), I*H, I, H, I, H, H, I)
	}
	return nil
}

// RandomWeights returns weights for cfg drawn uniformly from
// [-1/sqrt(fan_in), 1/sqrt(fan_in)] (the bound of nn.Linear's default init), with
// the correction bias (noaux_tc) uniform in [-0.05, 0.05]. The same cfg and seed
// always give the same weights, whatever GOMAXPROCS is. Experts are filled in
// parallel on the calling goroutine's behalf; nothing runs on a device.
func RandomWeights(cfg *Config, seed uint64) (*Weights, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("moe.RandomWeights: %w", err)
	}
	H, E, I := cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate
	fill := func(stream uint64, n, fanIn int) []float32 {
		r := rand.New(rand.NewPCG(seed, stream))
		b := 1 / math.Sqrt(float64(fanIn))
		out := make([]float32, n)
		for i := range out {
			out[i] = float32((2*r.Float64() - 1) * b)
		}
		return out
	}
	w := &Weights{DType: safetensors.F32, Experts: make([]Expert, E)}
	w.Router = fill(1, E*H, H)
	if cfg.HasBias() {
		w.Bias = fill(2, E, 400) // 1/sqrt(400) = 0.05
	}
	if cfg.SharedGate {
		w.SharedGate = fill(3, H, H)
	}
	if cfg.SharedIntermediate > 0 {
		S := cfg.SharedIntermediate
		w.Shared = &Expert{Gate: fill(4, S*H, H), Up: fill(5, S*H, H), Down: fill(6, H*S, S)}
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for e := 0; e < E; e++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(e int) {
			defer func() { <-sem; wg.Done() }()
			base := uint64(16 + 3*e)
			w.Experts[e] = Expert{Gate: fill(base, I*H, H), Up: fill(base+1, I*H, H), Down: fill(base+2, H*I, I)}
		}(e)
	}
	wg.Wait()
	return w, nil
}

// Layout names how a layer's expert tensors are stored in a checkpoint.
type Layout int

// Layouts LayerTensors can write and LoadWeights can read.
const (
	// PerExpert: experts.<e>.{gate,up,down}_proj.weight, as on the Hub.
	PerExpert Layout = iota
	// Fused: experts.gate_up_proj [E,2I,H] (gate rows first) and
	// experts.down_proj [E,H,I], as transformers 5 holds them in memory.
	Fused
	// MixtralHub: block_sparse_moe.gate.weight and
	// block_sparse_moe.experts.<e>.{w1,w3,w2}.weight (gate, up, down), as the
	// Mixtral checkpoints on the Hub name them.
	MixtralHub
)

// LayerPrefix returns the tensor name prefix of layer L's MoE block:
// "model.layers.<L>.mlp." (or "...block_sparse_moe." for MixtralHub).
func LayerPrefix(layer int, layout Layout) string {
	if layout == MixtralHub {
		return fmt.Sprintf("model.layers.%d.block_sparse_moe.", layer)
	}
	return fmt.Sprintf("model.layers.%d.mlp.", layer)
}

// sharedName returns the shared expert's module name in a checkpoint.
func sharedName(f Family) string {
	if f == Qwen2MoE {
		return "shared_expert"
	}
	return "shared_experts"
}

// LayerTensors returns w as checkpoint tensors of layer `layer` with the Hub's
// names in the given layout, converted to dt (F32, F16 or BF16). Use it with
// safetensors.Write to save a layer (tests, `moe run --output`).
func LayerTensors(cfg *Config, w *Weights, layer int, layout Layout, dt DType) ([]safetensors.Tensor, error) {
	if err := w.Check(cfg); err != nil {
		return nil, fmt.Errorf("moe.LayerTensors: %w", err)
	}
	if layout == MixtralHub && cfg.Family != Mixtral {
		return nil, fmt.Errorf("moe.LayerTensors: layout MixtralHub is for mixtral, not %s", cfg.Family)
	}
	H, E, I := cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate
	p := LayerPrefix(layer, layout)
	var out []safetensors.Tensor
	var err error
	add := func(name string, shape []int, data []float32) {
		if err != nil {
			return
		}
		var t safetensors.Tensor
		t, err = safetensors.FromFloat32(p+name, dt, shape, data)
		out = append(out, t)
	}
	add("gate.weight", []int{E, H}, w.Router)
	if w.Bias != nil {
		add("gate.e_score_correction_bias", []int{E}, w.Bias)
	}
	switch layout {
	case Fused:
		gu := make([]float32, 0, E*2*I*H)
		down := make([]float32, 0, E*H*I)
		for _, x := range w.Experts {
			gu = append(append(gu, x.Gate...), x.Up...)
			down = append(down, x.Down...)
		}
		add("experts.gate_up_proj", []int{E, 2 * I, H}, gu)
		add("experts.down_proj", []int{E, H, I}, down)
	case PerExpert, MixtralHub:
		g, u, d := "gate_proj", "up_proj", "down_proj"
		if layout == MixtralHub {
			g, u, d = "w1", "w3", "w2"
		}
		for e, x := range w.Experts {
			add(fmt.Sprintf("experts.%d.%s.weight", e, g), []int{I, H}, x.Gate)
			add(fmt.Sprintf("experts.%d.%s.weight", e, u), []int{I, H}, x.Up)
			add(fmt.Sprintf("experts.%d.%s.weight", e, d), []int{H, I}, x.Down)
		}
	default:
		return nil, fmt.Errorf("moe.LayerTensors: unknown layout %d", layout)
	}
	if w.Shared != nil {
		S, s := cfg.SharedIntermediate, sharedName(cfg.Family)
		add(s+".gate_proj.weight", []int{S, H}, w.Shared.Gate)
		add(s+".up_proj.weight", []int{S, H}, w.Shared.Up)
		add(s+".down_proj.weight", []int{H, S}, w.Shared.Down)
	}
	if w.SharedGate != nil {
		add("shared_expert_gate.weight", []int{1, H}, w.SharedGate)
	}
	if err != nil {
		return nil, fmt.Errorf("moe.LayerTensors: %w", err)
	}
	return out, nil
}

// checkpoint resolves tensor names to the shard files of a checkpoint directory
// and keeps the files it opened mapped until close.
type checkpoint struct {
	dir      string
	weight   map[string]string // tensor -> file, from the index (nil: single file)
	single   string
	open     map[string]*safetensors.File
	describe string
}

func openCheckpoint(dir string) (*checkpoint, error) {
	c := &checkpoint{dir: dir, open: map[string]*safetensors.File{}}
	idx := filepath.Join(dir, "model.safetensors.index.json")
	if data, err := os.ReadFile(idx); err == nil {
		var ix struct {
			WeightMap map[string]string `json:"weight_map"`
		}
		if err := json.Unmarshal(data, &ix); err != nil {
			return nil, fmt.Errorf("%s: %w", idx, err)
		}
		if len(ix.WeightMap) == 0 {
			return nil, fmt.Errorf("%s: weight_map is empty", idx)
		}
		for name, f := range ix.WeightMap {
			if f == "" || filepath.Base(f) != f {
				return nil, fmt.Errorf("%s: tensor %q maps to %q, want a file name in the same directory", idx, name, f)
			}
		}
		c.weight, c.describe = ix.WeightMap, idx
		return c, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	c.single = filepath.Join(dir, "model.safetensors")
	if _, err := os.Stat(c.single); err != nil {
		return nil, fmt.Errorf("no model.safetensors or model.safetensors.index.json in %s: %w", dir, err)
	}
	c.describe = c.single
	return c, nil
}

func (c *checkpoint) file(name string) (*safetensors.File, bool, error) {
	path := c.single
	if c.weight != nil {
		f, ok := c.weight[name]
		if !ok {
			return nil, false, nil
		}
		path = filepath.Join(c.dir, f)
	}
	if f, ok := c.open[path]; ok {
		_, has := f.Info(name)
		return f, has, nil
	}
	f, err := safetensors.Open(path)
	if err != nil {
		return nil, false, err
	}
	c.open[path] = f
	_, has := f.Info(name)
	return f, has, nil
}

func (c *checkpoint) has(name string) bool {
	_, ok, err := c.file(name)
	return err == nil && ok
}

func (c *checkpoint) close() {
	for _, f := range c.open {
		_ = f.Close()
	}
}

// read loads tensor name, checking its shape; the error names the tensor and the
// shape expected.
func (c *checkpoint) read(name string, shape ...int) ([]float32, DType, error) {
	f, ok, err := c.file(name)
	if err != nil {
		return nil, "", err
	}
	if !ok {
		return nil, "", fmt.Errorf("tensor %s (shape %v expected) is missing from %s", name, shape, c.describe)
	}
	info, _ := f.Info(name)
	if !slices.Equal(info.Shape, shape) {
		return nil, "", fmt.Errorf("tensor %s has shape %v, expected %v (in %s)", name, info.Shape, shape, f.Path)
	}
	switch info.DType {
	case safetensors.F32, safetensors.BF16, safetensors.F16:
	default:
		return nil, "", fmt.Errorf("tensor %s has dtype %s; want F32, BF16 or F16 (in %s)", name, info.DType, f.Path)
	}
	v, _, err := f.Float32(name)
	return v, info.DType, err
}

// LoadWeights loads MoE layer `layer` of the checkpoint in dir (model.safetensors,
// or model.safetensors.index.json and its shards) for cfg. It maps the files
// read-only, converts only this layer's tensors to float32 and unmaps them before
// returning. Experts may be stored per expert (experts.<e>.gate_proj.weight, ...),
// fused (experts.gate_up_proj [E,2I,H], experts.down_proj [E,H,I]) or, for
// Mixtral, under block_sparse_moe with w1/w3/w2. A dense layer, a missing or
// misshaped tensor, or an unsupported dtype is an error naming it. It runs on the
// calling goroutine and touches no device.
func LoadWeights(dir string, cfg *Config, layer int) (*Weights, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("moe.LoadWeights: %w", err)
	}
	if err := cfg.CheckMoELayer(layer); err != nil {
		return nil, fmt.Errorf("moe.LoadWeights: %w", err)
	}
	ck, err := openCheckpoint(dir)
	if err != nil {
		return nil, fmt.Errorf("moe.LoadWeights: %w", err)
	}
	defer ck.close()
	w, err := loadLayer(ck, cfg, layer)
	if err != nil {
		return nil, fmt.Errorf("moe.LoadWeights layer %d: %w", layer, err)
	}
	return w, nil
}

func loadLayer(ck *checkpoint, cfg *Config, layer int) (*Weights, error) {
	H, E, I := cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate
	layout := PerExpert
	p := LayerPrefix(layer, PerExpert)
	if cfg.Family == Mixtral && ck.has(LayerPrefix(layer, MixtralHub)+"gate.weight") {
		layout, p = MixtralHub, LayerPrefix(layer, MixtralHub)
	} else if ck.has(p + "experts.gate_up_proj") {
		layout = Fused
	}
	w := &Weights{DTypes: map[string]DType{}, Experts: make([]Expert, E)}
	var err error
	get := func(name string, shape ...int) []float32 {
		if err != nil {
			return nil
		}
		var v []float32
		var dt DType
		v, dt, err = ck.read(p+name, shape...)
		w.DTypes[name] = dt
		return v
	}
	w.Router = get("gate.weight", E, H)
	if cfg.HasBias() {
		w.Bias = get("gate.e_score_correction_bias", E)
	}
	switch layout {
	case Fused:
		gu := get("experts.gate_up_proj", E, 2*I, H)
		down := get("experts.down_proj", E, H, I)
		if err == nil {
			for e := range w.Experts {
				blk := gu[e*2*I*H : (e+1)*2*I*H]
				w.Experts[e] = Expert{Gate: blk[: I*H : I*H], Up: blk[I*H:], Down: down[e*H*I : (e+1)*H*I]}
			}
			w.DType = w.DTypes["experts.gate_up_proj"]
		}
	default:
		g, u, d := "gate_proj", "up_proj", "down_proj"
		if layout == MixtralHub {
			g, u, d = "w1", "w3", "w2"
		}
		for e := 0; e < E && err == nil; e++ {
			w.Experts[e] = Expert{
				Gate: get(fmt.Sprintf("experts.%d.%s.weight", e, g), I, H),
				Up:   get(fmt.Sprintf("experts.%d.%s.weight", e, u), I, H),
				Down: get(fmt.Sprintf("experts.%d.%s.weight", e, d), H, I),
			}
		}
		w.DType = w.DTypes[fmt.Sprintf("experts.0.%s.weight", g)]
	}
	if S := cfg.SharedIntermediate; S > 0 {
		s := sharedName(cfg.Family)
		w.Shared = &Expert{
			Gate: get(s+".gate_proj.weight", S, H),
			Up:   get(s+".up_proj.weight", S, H),
			Down: get(s+".down_proj.weight", H, S),
		}
	}
	if cfg.SharedGate {
		w.SharedGate = get("shared_expert_gate.weight", 1, H)
	}
	if err != nil {
		return nil, err
	}
	return w, nil
}

// TensorNames returns the names of all tensors a checkpoint directory holds under
// layer's MoE prefix, sorted; useful to diagnose a load error.
func TensorNames(dir string, layer int) ([]string, error) {
	ck, err := openCheckpoint(dir)
	if err != nil {
		return nil, fmt.Errorf("moe.TensorNames: %w", err)
	}
	defer ck.close()
	var names []string
	prefixes := []string{LayerPrefix(layer, PerExpert), LayerPrefix(layer, MixtralHub)}
	match := func(n string) bool {
		for _, p := range prefixes {
			if len(n) >= len(p) && n[:len(p)] == p {
				return true
			}
		}
		return false
	}
	if ck.weight != nil {
		for n := range ck.weight {
			if match(n) {
				names = append(names, n)
			}
		}
	} else {
		f, err := safetensors.Open(ck.single)
		if err != nil {
			return nil, fmt.Errorf("moe.TensorNames: %w", err)
		}
		defer f.Close()
		for n := range f.Header.Tensors {
			if match(n) {
				names = append(names, n)
			}
		}
	}
	sort.Strings(names)
	return names, nil
}
