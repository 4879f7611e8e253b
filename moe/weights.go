package moe

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/gpuctx/gpuctx/internal/regfile"
	"github.com/gpuctx/gpuctx/moe/safetensors"
	"golang.org/x/sync/errgroup"
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
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for e := 0; e < E; e++ {
		g.Go(func() error {
			base := uint64(16 + 3*e)
			w.Experts[e] = Expert{Gate: fill(base, I*H, H), Up: fill(base+1, I*H, H), Down: fill(base+2, H*I, I)}
			return nil
		})
	}
	return w, g.Wait() // the fills never fail
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

// tensorName is the one table of a layer's checkpoint tensor names, relative
// to the layer prefix (LayerPrefix): LayerTensors writes them, LoadWeights and
// LoadLayer read them. It returns the tensor that holds part p (of routed
// expert e) of a family-f layer stored in layout: in the Fused layout, wGate
// and wUp are rows of experts.gate_up_proj and wDown of experts.down_proj.
func tensorName(f Family, layout Layout, p weightPart, e int) string {
	switch p {
	case wRouter:
		return "gate.weight"
	case wBias:
		return "gate.e_score_correction_bias"
	case wGate, wUp, wDown:
		proj := [...]string{"gate_proj", "up_proj", "down_proj"}
		switch {
		case layout == Fused && p == wDown:
			return "experts.down_proj"
		case layout == Fused:
			return "experts.gate_up_proj"
		case layout == MixtralHub:
			proj = [...]string{"w1", "w3", "w2"}
		}
		return fmt.Sprintf("experts.%d.%s.weight", e, proj[p-wGate])
	case wSharedGateProj:
		return sharedName(f) + ".gate_proj.weight"
	case wSharedUpProj:
		return sharedName(f) + ".up_proj.weight"
	case wSharedDownProj:
		return sharedName(f) + ".down_proj.weight"
	case wSharedExpertGate:
		return "shared_expert_gate.weight"
	}
	panic(fmt.Sprintf("moe: unknown weight part %d", p))
}

// layerSpecs returns every tensor a layer of cfg stored in layout holds, with
// its shape, in load order.
func layerSpecs(cfg *Config, layout Layout) []tensorSpec {
	H, E, I, S, f := cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate, cfg.SharedIntermediate, cfg.Family
	var specs []tensorSpec
	add := func(p weightPart, e int, shape ...int) {
		specs = append(specs, tensorSpec{tensorName(f, layout, p, e), shape, p, e})
	}
	add(wRouter, 0, E, H)
	if cfg.HasBias() {
		add(wBias, 0, E)
	}
	if layout == Fused {
		add(wGate, 0, E, 2*I, H)
		add(wDown, 0, E, H, I)
	} else {
		for e := 0; e < E; e++ {
			add(wGate, e, I, H)
			add(wUp, e, I, H)
			add(wDown, e, H, I)
		}
	}
	if S > 0 {
		add(wSharedGateProj, 0, S, H)
		add(wSharedUpProj, 0, S, H)
		add(wSharedDownProj, 0, H, S)
	}
	if cfg.SharedGate {
		add(wSharedExpertGate, 0, 1, H)
	}
	return specs
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
	if layout != PerExpert && layout != Fused && layout != MixtralHub {
		return nil, fmt.Errorf("moe.LayerTensors: unknown layout %d", layout)
	}
	p := LayerPrefix(layer, layout)
	out := make([]safetensors.Tensor, 0, len(w.Experts)*3+6)
	for _, sp := range layerSpecs(cfg, layout) {
		t, err := safetensors.FromFloat32(p+sp.name, dt, sp.shape, tensorValues(w, layout, sp))
		if err != nil {
			return nil, fmt.Errorf("moe.LayerTensors: %w", err)
		}
		out = append(out, t)
	}
	return out, nil
}

// tensorValues returns the values of tensor sp (see layerSpecs) of w stored
// in layout.
func tensorValues(w *Weights, layout Layout, sp tensorSpec) []float32 {
	if layout != Fused || (sp.part != wGate && sp.part != wDown) {
		return memWeights{w}.part(sp.part, sp.expert)
	}
	var v []float32
	for _, x := range w.Experts {
		if sp.part == wDown {
			v = append(v, x.Down...)
		} else {
			v = append(append(v, x.Gate...), x.Up...)
		}
	}
	return v
}

// MaxIndexBytes bounds the size of model.safetensors.index.json.
const MaxIndexBytes = 64 << 20

// indexName is the file name of a sharded checkpoint's index.
const indexName = "model.safetensors.index.json"

// checkpoint resolves tensor names to the shard files of a checkpoint directory
// and keeps the files it opened until close.
type checkpoint struct {
	dir      string
	weight   map[string]string // tensor -> file, from the index (nil: single file)
	single   string
	open     map[string]*safetensors.File
	describe string
}

// validShardName reports whether f is a plain file name: not empty, not . or
// .., no directory separator (either kind), no NUL, and local to the directory.
func validShardName(f string) bool {
	return f != "" && f != "." && f != ".." && len(f) <= 255 && !strings.ContainsAny(f, "/\\\x00") && filepath.IsLocal(f)
}

// parseIndex parses the contents of model.safetensors.index.json and returns its
// weight_map (tensor name -> shard file name). Every shard must be a plain file
// name inside the model directory, and a tensor listed twice is an error.
func parseIndex(data []byte) (map[string]string, error) {
	var ix struct {
		WeightMap json.RawMessage `json:"weight_map"`
	}
	if err := json.Unmarshal(data, &ix); err != nil {
		return nil, fmt.Errorf("not a valid index: %w", err)
	}
	if len(ix.WeightMap) == 0 || string(ix.WeightMap) == "null" {
		return nil, errors.New("the index has no weight_map; want {\"weight_map\": {\"<tensor>\": \"<shard>.safetensors\", ...}}")
	}
	dec := json.NewDecoder(bytes.NewReader(ix.WeightMap))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, errors.New("weight_map is not a JSON object mapping tensor names to shard file names")
	}
	wm := map[string]string{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("weight_map: %w", err)
		}
		name, _ := tok.(string)
		var f string
		if err := dec.Decode(&f); err != nil {
			return nil, fmt.Errorf("weight_map: tensor %q: the shard must be a file name (a string): %w", name, err)
		}
		if _, dup := wm[name]; dup {
			return nil, fmt.Errorf("weight_map lists tensor %q twice", name)
		}
		if !validShardName(f) {
			return nil, fmt.Errorf("weight_map: tensor %q maps to %q; a shard must be a plain file name inside the model directory", name, f)
		}
		wm[name] = f
	}
	if len(wm) == 0 {
		return nil, errors.New("weight_map is empty")
	}
	return wm, nil
}

func openCheckpoint(dir string) (*checkpoint, error) {
	c := &checkpoint{dir: dir, open: map[string]*safetensors.File{}}
	idx := filepath.Join(dir, indexName)
	if _, err := os.Lstat(idx); err == nil {
		data, err := regfile.ReadFile(idx, MaxIndexBytes)
		if err != nil {
			return nil, err
		}
		wm, err := parseIndex(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", idx, err)
		}
		c.weight, c.describe = wm, idx
		return c, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	c.single = filepath.Join(dir, "model.safetensors")
	if _, err := os.Stat(c.single); err != nil {
		return nil, fmt.Errorf("no model.safetensors or %s in %s: %w", indexName, dir, err)
	}
	c.describe = c.single
	return c, nil
}

// files returns the paths of the checkpoint's files: the index and its shards
// (sorted), or model.safetensors.
func (c *checkpoint) files() []string {
	if c.weight == nil {
		return []string{c.single}
	}
	set := map[string]bool{}
	for _, f := range c.weight {
		set[f] = true
	}
	out := []string{filepath.Join(c.dir, indexName)}
	for _, f := range slices.Sorted(maps.Keys(set)) {
		out = append(out, filepath.Join(c.dir, f))
	}
	return out
}

// CheckpointFiles returns the paths of the files of the checkpoint in dir that a
// run may read: model.safetensors.index.json and every shard it names, or
// model.safetensors (config.json is not included). Use it to refuse an output
// path that would overwrite the model.
func CheckpointFiles(dir string) ([]string, error) {
	ck, err := openCheckpoint(dir)
	if err != nil {
		return nil, fmt.Errorf("moe.CheckpointFiles: %w", err)
	}
	defer ck.close()
	return ck.files(), nil
}

// file returns the open file holding tensor name (nil, false when no file
// lists it). A shard the index names but the directory lacks is an error naming
// the shard.
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
		if errors.Is(err, fs.ErrNotExist) && c.weight != nil {
			return nil, false, fmt.Errorf("shard %s, which %s lists for tensor %s, does not exist in %s; download it, or fix the index", filepath.Base(path), indexName, name, c.dir)
		}
		return nil, false, err
	}
	c.open[path] = f
	_, has := f.Info(name)
	return f, has, nil
}

func (c *checkpoint) has(name string) (bool, error) {
	_, ok, err := c.file(name)
	return ok, err
}

func (c *checkpoint) close() {
	for _, f := range c.open {
		_ = f.Close()
	}
}

// names returns every tensor name of the checkpoint (from the index, or the
// single file's header).
func (c *checkpoint) names() ([]string, error) {
	if c.weight != nil {
		return slices.Sorted(maps.Keys(c.weight)), nil
	}
	f, _, err := c.file("")
	if err != nil {
		return nil, err
	}
	return f.Header.Names(), nil
}

// info returns tensor name's description after checking that it exists, has the
// shape expected and a dtype that converts to float32; the error names the
// tensor, the file and what was expected. Nothing is read but the header.
func (c *checkpoint) info(name string, shape ...int) (*safetensors.File, safetensors.TensorInfo, error) {
	f, ok, err := c.file(name)
	if err != nil {
		return nil, safetensors.TensorInfo{}, err
	}
	if !ok {
		return nil, safetensors.TensorInfo{}, fmt.Errorf("tensor %s (shape %v expected) is missing from %s", name, shape, c.describe)
	}
	info, _ := f.Info(name)
	if !slices.Equal(info.Shape, shape) {
		return nil, info, fmt.Errorf("tensor %s has shape %v, expected %v (in %s)", name, info.Shape, shape, f.Path)
	}
	if info.DType == safetensors.F8E4M3 {
		return f, info, nil // checked with its scales (fp8Scales)
	}
	if !info.DType.IsFloat() || info.DType == safetensors.F64 {
		return nil, info, fmt.Errorf("tensor %s has dtype %s; want F32, BF16 or F16, or F8_E4M3 with block scales (in %s)", name, info.DType, f.Path)
	}
	return f, info, nil
}

// LoadWeights loads MoE layer `layer` of the checkpoint in dir (model.safetensors,
// or model.safetensors.index.json and its shards) for cfg. It first checks that
// every tensor the layer needs is present with the right shape and dtype (reading
// headers only), then reads and converts only this layer's tensors to float32.
// Experts may be stored per expert (experts.<e>.gate_proj.weight, ...), fused
// (experts.gate_up_proj [E,2I,H], experts.down_proj [E,H,I]) or, for Mixtral,
// under block_sparse_moe with w1/w3/w2. An FP8 checkpoint's F8_E4M3 weights
// (cfg.Quant set) are dequantized (fp8.Weight.Dequantize) after their scales
// are checked. A dense layer, a missing or misshaped tensor, a missing shard,
// an unsupported dtype or a bad FP8 scale or code is an error naming it. It runs
// on the calling goroutine and touches no device. To put the layer on a
// device, LoadLayer reads the same tensors without the float32 copy.
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

type tensorSpec struct {
	name   string // relative to the layer prefix
	shape  []int
	part   weightPart // what it holds (wGate and wDown: every expert's, in the Fused layout)
	expert int        // the routed expert of wGate, wUp, wDown (per-expert layouts)
}

// checkedTensor is a tensor of a checkpoint whose header entry was checked.
// An F8_E4M3 weight has its block scales (checked: finite and positive),
// scales [ceil(rows/block[0])][ceil(cols/block[1])]; other tensors none.
type checkedTensor struct {
	f      *safetensors.File
	info   safetensors.TensorInfo
	scales []float32
	block  [2]int
}

// layerLayout is how one MoE layer's tensors are stored in a checkpoint, every
// tensor checked against the headers (present, with the shape cfg wants and a
// dtype that converts to float32).
type layerLayout struct {
	layout  Layout
	prefix  string                   // LayerPrefix(layer, layout)
	family  Family                   // the config's family (the shared expert's module name)
	specs   []tensorSpec             // every tensor the layer needs, in load order
	tensors map[string]checkedTensor // by name relative to prefix
}

// resolveLayer finds layer's layout in the checkpoint (per expert, fused, or
// Mixtral's block_sparse_moe) and checks every tensor it needs against the
// headers; nothing but headers is read. The error names the first missing or
// misshaped tensor, its file and what was expected.
func resolveLayer(ck *checkpoint, cfg *Config, layer int) (*layerLayout, error) {
	f := cfg.Family
	ll := &layerLayout{layout: PerExpert, prefix: LayerPrefix(layer, PerExpert), family: f}
	if f == Mixtral {
		ok, err := ck.has(LayerPrefix(layer, MixtralHub) + tensorName(f, MixtralHub, wRouter, 0))
		if err != nil {
			return nil, err
		}
		if ok {
			ll.layout, ll.prefix = MixtralHub, LayerPrefix(layer, MixtralHub)
		}
	}
	if ll.layout == PerExpert {
		ok, err := ck.has(ll.prefix + tensorName(f, Fused, wGate, 0))
		if err != nil {
			return nil, err
		}
		if ok {
			ll.layout = Fused
		}
	}
	ll.specs = layerSpecs(cfg, ll.layout)
	ll.tensors = make(map[string]checkedTensor, len(ll.specs))
	for _, sp := range ll.specs {
		f, info, err := ck.info(ll.prefix+sp.name, sp.shape...)
		if err != nil {
			return nil, err
		}
		ct := checkedTensor{f: f, info: info}
		if info.DType == safetensors.F8E4M3 {
			if ct.scales, err = ck.fp8Scales(ll.prefix+sp.name, sp.shape, cfg.Quant); err != nil {
				return nil, err
			}
			ct.block = cfg.Quant.Block()
		}
		ll.tensors[sp.name] = ct
	}
	return ll, nil
}

// float32s reads tensor name (of shape) as float32 values: widened, or for
// an FP8 weight dequantized (code * scale_inv).
func (t *checkedTensor) float32s(name string, shape []int) ([]float32, error) {
	if t.scales == nil {
		v, _, err := t.f.Float32(name)
		return v, err
	}
	w, err := t.fp8Weight(name, 0, shape[0], shape[1])
	if err != nil {
		return nil, err
	}
	return w.Dequantize()
}

// name returns the name of part p (of routed expert e), relative to the
// layer prefix.
func (ll *layerLayout) name(p weightPart, e int) string {
	return tensorName(ll.family, ll.layout, p, e)
}

func loadLayer(ck *checkpoint, cfg *Config, layer int) (*Weights, error) {
	// Check everything against the headers before allocating anything.
	ll, err := resolveLayer(ck, cfg, layer)
	if err != nil {
		return nil, err
	}
	H, E, I := cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate
	w := &Weights{DTypes: map[string]DType{}, Experts: make([]Expert, E)}
	vals := make(map[string][]float32, len(ll.specs))
	for _, sp := range ll.specs {
		t := ll.tensors[sp.name]
		v, err := t.float32s(ll.prefix+sp.name, sp.shape)
		if err != nil {
			return nil, err
		}
		vals[sp.name], w.DTypes[sp.name] = v, t.info.DType
	}
	w.Router = vals[ll.name(wRouter, 0)]
	w.Bias = vals[ll.name(wBias, 0)]
	switch ll.layout {
	case Fused:
		gu, down := vals[ll.name(wGate, 0)], vals[ll.name(wDown, 0)]
		for e := range w.Experts {
			blk := gu[e*2*I*H : (e+1)*2*I*H]
			w.Experts[e] = Expert{Gate: blk[: I*H : I*H], Up: blk[I*H:], Down: down[e*H*I : (e+1)*H*I]}
		}
	default:
		for e := range w.Experts {
			w.Experts[e] = Expert{Gate: vals[ll.name(wGate, e)], Up: vals[ll.name(wUp, e)], Down: vals[ll.name(wDown, e)]}
		}
	}
	w.DType = w.DTypes[ll.name(wGate, 0)]
	if cfg.SharedIntermediate > 0 {
		w.Shared = &Expert{Gate: vals[ll.name(wSharedGateProj, 0)], Up: vals[ll.name(wSharedUpProj, 0)], Down: vals[ll.name(wSharedDownProj, 0)]}
	}
	if cfg.SharedGate {
		w.SharedGate = vals[ll.name(wSharedExpertGate, 0)]
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
	all, err := ck.names()
	if err != nil {
		return nil, fmt.Errorf("moe.TensorNames: %w", err)
	}
	var names []string
	prefixes := []string{LayerPrefix(layer, PerExpert), LayerPrefix(layer, MixtralHub)}
	for _, n := range all {
		if strings.HasPrefix(n, prefixes[0]) || strings.HasPrefix(n, prefixes[1]) {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return names, nil
}

// MoELayersInCheckpoint returns, sorted, the layers of the checkpoint in dir that
// hold an MoE router (model.layers.<L>.mlp.gate.weight, or Mixtral's
// block_sparse_moe.gate.weight) and that cfg says are MoE layers. It looks only
// at the tensor names present, so its cost is bounded by the checkpoint, not by
// num_hidden_layers.
func MoELayersInCheckpoint(dir string, cfg *Config) ([]int, error) {
	ck, err := openCheckpoint(dir)
	if err != nil {
		return nil, fmt.Errorf("moe.MoELayersInCheckpoint: %w", err)
	}
	defer ck.close()
	all, err := ck.names()
	if err != nil {
		return nil, fmt.Errorf("moe.MoELayersInCheckpoint: %w", err)
	}
	set := map[int]bool{}
	for _, n := range all {
		rest, ok := strings.CutPrefix(n, "model.layers.")
		if !ok {
			continue
		}
		num, tail, ok := strings.Cut(rest, ".")
		if !ok || (tail != "mlp.gate.weight" && tail != "block_sparse_moe.gate.weight") {
			continue
		}
		l, err := strconv.Atoi(num)
		if err != nil || l < 0 || strconv.Itoa(l) != num {
			continue
		}
		if cfg.CheckMoELayer(l) == nil {
			set[l] = true
		}
	}
	return slices.Sorted(maps.Keys(set)), nil
}
