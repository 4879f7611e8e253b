package moe

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"reflect"
	"slices"
	"strings"

	"github.com/gpuctx/gpuctx/internal/regfile"
	"github.com/gpuctx/gpuctx/moe/fp8"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// Hard limits on the sizes a Config may describe. They are far above every
// published MoE model and keep a corrupt or hostile config.json from making the
// loader allocate or loop without bound; the expert and top-k limits are those
// of the MoE kernels (MaxExperts, MaxTopK).
const (
	// MaxHiddenSize bounds hidden_size.
	MaxHiddenSize = 1 << 16
	// MaxIntermediate bounds the routed experts' width (moe_intermediate_size,
	// Mixtral's intermediate_size) and the shared expert's total width.
	MaxIntermediate = 1 << 17
	// MaxSharedExperts bounds DeepSeek's n_shared_experts.
	MaxSharedExperts = 64
	// MaxLayers bounds num_hidden_layers and every layer index or period
	// (first_k_dense_replace, moe_layer_freq, decoder_sparse_step,
	// mlp_only_layers).
	MaxLayers = 1 << 14
	// MaxConfigBytes bounds the size of config.json.
	MaxConfigBytes = 16 << 20
)

// Family is a Hugging Face model_type whose MoE block this package implements.
type Family string

// The supported families. Each follows the MoE block of its transformers 5.x
// modeling file (DeepseekV2Moe, DeepseekV3MoE, Qwen2MoeSparseMoeBlock,
// Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock).
const (
	DeepseekV2 Family = "deepseek_v2" // DeepSeek-V2, V2-Lite: softmax, greedy or group_limited_greedy
	DeepseekV3 Family = "deepseek_v3" // DeepSeek-V3: sigmoid, noaux_tc with correction bias
	Qwen2MoE   Family = "qwen2_moe"   // Qwen1.5-MoE, Qwen2-MoE: softmax, gated shared expert
	Qwen3MoE   Family = "qwen3_moe"   // Qwen3-MoE: softmax, no shared expert
	Mixtral    Family = "mixtral"     // Mixtral: softmax, always renormalised
)

// Scoring is how router logits become per-expert scores.
type Scoring string

// Scoring functions.
const (
	Softmax Scoring = "softmax" // softmax over all experts
	Sigmoid Scoring = "sigmoid" // independent sigmoid per expert
)

// TopKMethod is how experts are selected from the scores.
type TopKMethod string

// Selection methods.
const (
	// Greedy takes the K highest scores.
	Greedy TopKMethod = "greedy"
	// GroupLimitedGreedy (DeepSeek-V2) scores each of NumGroups expert groups by
	// its highest expert score, keeps the TopKGroups best groups, zeroes the
	// scores of the others and then takes the K highest scores.
	GroupLimitedGreedy TopKMethod = "group_limited_greedy"
	// NoAuxTC (DeepSeek-V3) adds the correction bias to the sigmoid scores for
	// selection only, scores each group by the sum of its two highest biased
	// scores, keeps the TopKGroups best groups, zeroes the others and takes the K
	// highest biased scores; the weights are the unbiased scores.
	NoAuxTC TopKMethod = "noaux_tc"
)

// Config describes one MoE layer (and, for the dense/sparse layer pattern, the
// model it comes from). It is plain data: safe to read from many goroutines, and
// the device forward may keep a pointer to it as long as nobody mutates it.
type Config struct {
	// Family is the Hugging Face model_type.
	Family Family
	// HiddenSize is H, the token width.
	HiddenSize int
	// NumExperts is E, the number of routed experts.
	NumExperts int
	// TopK is K, the experts chosen per token (num_experts_per_tok).
	TopK int
	// Intermediate is I, the width of each routed expert's SwiGLU
	// (moe_intermediate_size; Mixtral: intermediate_size).
	Intermediate int
	// SharedIntermediate is the width of the shared expert, 0 when there is none
	// (DeepSeek: n_shared_experts x moe_intermediate_size; Qwen2-MoE:
	// shared_expert_intermediate_size).
	SharedIntermediate int
	// SharedGate is true when the shared expert's output is scaled by
	// sigmoid(shared_expert_gate . x) (Qwen2-MoE).
	SharedGate bool
	// Scoring turns router logits into scores.
	Scoring Scoring
	// TopKMethod selects the experts.
	TopKMethod TopKMethod
	// NumGroups (n_group) and TopKGroups (topk_group) are used by the grouped
	// methods only; they are 1 otherwise.
	NumGroups, TopKGroups int
	// NormTopKProb renormalises the K selected weights to sum to 1 (DeepSeek-V3
	// adds 1e-20 to the denominator).
	NormTopKProb bool
	// RoutedScalingFactor multiplies the routed weights after renormalisation
	// (DeepSeek only; 1 elsewhere).
	RoutedScalingFactor float64
	// HiddenAct is the expert activation; only "silu" is supported.
	HiddenAct string

	// NumHiddenLayers is the number of decoder layers (0 when unknown).
	NumHiddenLayers int
	// FirstKDenseReplace and MoELayerFreq (DeepSeek): layer L is MoE when
	// L >= FirstKDenseReplace and L % MoELayerFreq == 0.
	FirstKDenseReplace, MoELayerFreq int
	// DecoderSparseStep and MLPOnlyLayers (Qwen): layer L is MoE when L is not in
	// MLPOnlyLayers and (L+1) % DecoderSparseStep == 0.
	DecoderSparseStep int
	MLPOnlyLayers     []int

	// Quant is config.json's quantization_config when the checkpoint stores
	// its projection weights in block-scaled FP8 (DeepSeek-V3/R1,
	// Qwen3-FP8), else nil. LoadWeights and LoadLayer then read those
	// weights as F8_E4M3 with their weight_scale_inv; see fp8.ParseQuantConfig
	// for what is accepted.
	Quant *fp8.QuantConfig
}

// rawConfig holds the config.json fields we read. Pointers tell absent from zero.
type rawConfig struct {
	ModelType                    *string  `json:"model_type"`
	HiddenSize                   *int     `json:"hidden_size"`
	NRoutedExperts               *int     `json:"n_routed_experts"`
	NumExperts                   *int     `json:"num_experts"`
	NumLocalExperts              *int     `json:"num_local_experts"`
	NumExpertsPerTok             *int     `json:"num_experts_per_tok"`
	MoEIntermediateSize          *int     `json:"moe_intermediate_size"`
	IntermediateSize             *int     `json:"intermediate_size"`
	NSharedExperts               *int     `json:"n_shared_experts"`
	SharedExpertIntermediateSize *int     `json:"shared_expert_intermediate_size"`
	ScoringFunc                  *string  `json:"scoring_func"`
	TopKMethod                   *string  `json:"topk_method"`
	NGroup                       *int     `json:"n_group"`
	TopKGroup                    *int     `json:"topk_group"`
	NormTopKProb                 *bool    `json:"norm_topk_prob"`
	RoutedScalingFactor          *float64 `json:"routed_scaling_factor"`
	HiddenAct                    *string  `json:"hidden_act"`
	NumHiddenLayers              *int     `json:"num_hidden_layers"`
	FirstKDenseReplace           *int     `json:"first_k_dense_replace"`
	MoELayerFreq                 *int     `json:"moe_layer_freq"`
	DecoderSparseStep            *int     `json:"decoder_sparse_step"`
	MLPOnlyLayers                []int    `json:"mlp_only_layers"`

	// quantization_config, parsed by fp8.ParseQuantConfig (Config.Quant).
	QuantizationConfig json.RawMessage `json:"quantization_config"`
}

// family defaults: exactly the defaults of the transformers 5.x configuration
// classes (DeepseekV2Config, DeepseekV3Config, Qwen2MoeConfig, Qwen3MoeConfig,
// MixtralConfig). nil pointers mean "no default" (the field is required).
type defaults struct {
	hidden, experts, intermediate, layers int
	topK                                  *int
	nShared, sharedIntermediate           int
	nGroup, topkGroup                     *int
	norm                                  bool
	scale                                 float64
	firstKDense                           int
}

func ip(v int) *int { return &v }

var familyDefaults = map[Family]defaults{
	// DeepseekV2Config: hidden 4096, n_routed 64, moe_intermediate 1407,
	// n_shared 2, num_experts_per_tok None, n_group/topk_group None,
	// topk_method greedy, norm_topk_prob False, routed_scaling_factor 1.0,
	// first_k_dense_replace 0, num_hidden_layers 32.
	DeepseekV2: {hidden: 4096, experts: 64, intermediate: 1407, layers: 32, nShared: 2, scale: 1.0},
	// DeepseekV3Config: hidden 7168, n_routed 256, moe_intermediate 2048,
	// n_shared 1, num_experts_per_tok 8, n_group 8, topk_group 4,
	// norm_topk_prob True, routed_scaling_factor 2.5, first_k_dense_replace 3,
	// num_hidden_layers 61.
	DeepseekV3: {hidden: 7168, experts: 256, intermediate: 2048, layers: 61, topK: ip(8), nShared: 1,
		nGroup: ip(8), topkGroup: ip(4), norm: true, scale: 2.5, firstKDense: 3},
	// Qwen2MoeConfig: hidden 2048, num_experts 60, moe_intermediate 1408,
	// shared_expert_intermediate_size 5632, num_experts_per_tok 4,
	// norm_topk_prob False, num_hidden_layers 24, decoder_sparse_step 1.
	Qwen2MoE: {hidden: 2048, experts: 60, intermediate: 1408, layers: 24, topK: ip(4), sharedIntermediate: 5632, scale: 1},
	// Qwen3MoeConfig: hidden 2048, num_experts 128, moe_intermediate 768,
	// num_experts_per_tok 8, norm_topk_prob False, num_hidden_layers 24.
	Qwen3MoE: {hidden: 2048, experts: 128, intermediate: 768, layers: 24, topK: ip(8), scale: 1},
	// MixtralConfig: hidden 4096, num_local_experts 8, intermediate 14336,
	// num_experts_per_tok 2, num_hidden_layers 32; routing always renormalises.
	Mixtral: {hidden: 4096, experts: 8, intermediate: 14336, layers: 32, topK: ip(2), norm: true, scale: 1},
}

// LoadConfig reads dir/config.json (a Hugging Face model configuration) and
// returns the MoE layer configuration it describes. Absent fields take the
// defaults of the family's transformers configuration class; unsupported values
// are errors naming the field and the value. It runs on the calling goroutine and
// touches no device.
func LoadConfig(dir string) (*Config, error) {
	p := filepath.Join(dir, "config.json")
	data, err := regfile.ReadFile(p, MaxConfigBytes)
	if err != nil {
		return nil, fmt.Errorf("moe.LoadConfig: %w", err)
	}
	c, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("moe.LoadConfig %s: %w", p, err)
	}
	return c, nil
}

// ParseConfig parses the contents of a config.json; see LoadConfig.
func ParseConfig(data []byte) (*Config, error) {
	var r rawConfig
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, jsonError(err)
	}
	if err := checkRawRanges(&r); err != nil {
		return nil, err
	}
	c, d, err := r.common()
	if err != nil {
		return nil, err
	}
	switch c.Family {
	case DeepseekV2, DeepseekV3:
		err = r.deepseek(c, d)
	case Qwen2MoE, Qwen3MoE:
		err = r.qwen(c, d)
	case Mixtral:
		if !c.NormTopKProb {
			err = errors.New("norm_topk_prob = false is not supported for mixtral: MixtralTopKRouter always renormalises")
		}
	}
	if err != nil {
		return nil, err
	}
	if len(r.QuantizationConfig) > 0 && string(r.QuantizationConfig) != "null" {
		if c.Quant, err = fp8.ParseQuantConfig(r.QuantizationConfig); err != nil {
			return nil, err
		}
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if c.NumHiddenLayers > 0 {
		if _, err := c.FirstMoELayer(); err != nil {
			return nil, fmt.Errorf("%w; check num_hidden_layers, first_k_dense_replace, moe_layer_freq, decoder_sparse_step and mlp_only_layers", err)
		}
	}
	return c, nil
}

// orDefault returns *p, or def when p is nil (the field is absent).
func orDefault(p *int, def int) int {
	if p != nil {
		return *p
	}
	return def
}

// common returns the Config of r's family with the fields every family reads
// (sizes, experts, top-k, norm_topk_prob) set, and the family's defaults.
func (r *rawConfig) common() (*Config, defaults, error) {
	if r.ModelType == nil {
		return nil, defaults{}, errors.New("config.json has no model_type; want one of deepseek_v2, deepseek_v3, qwen2_moe, qwen3_moe, mixtral")
	}
	fam := Family(*r.ModelType)
	d, ok := familyDefaults[fam]
	if !ok {
		return nil, defaults{}, fmt.Errorf("model_type %q is not supported; want one of deepseek_v2, deepseek_v3, qwen2_moe, qwen3_moe, mixtral", *r.ModelType)
	}
	c := &Config{
		Family:          fam,
		HiddenSize:      orDefault(r.HiddenSize, d.hidden),
		HiddenAct:       "silu",
		NumHiddenLayers: orDefault(r.NumHiddenLayers, d.layers),
		NumGroups:       1, TopKGroups: 1,
		MoELayerFreq: 1, DecoderSparseStep: 1,
		RoutedScalingFactor: 1,
		Scoring:             Softmax,
		TopKMethod:          Greedy,
		NumExperts:          orDefault(r.experts(fam), d.experts),
		NormTopKProb:        d.norm,
	}
	if r.HiddenAct != nil {
		c.HiddenAct = *r.HiddenAct
	}
	switch {
	case r.NumExpertsPerTok != nil:
		c.TopK = *r.NumExpertsPerTok
	case d.topK != nil:
		c.TopK = *d.topK
	default:
		return nil, defaults{}, fmt.Errorf("num_experts_per_tok is absent and %s has no default (transformers treats the model as dense); set it", fam)
	}
	if fam == Mixtral {
		if r.IntermediateSize != nil && *r.IntermediateSize > MaxIntermediate {
			return nil, defaults{}, fmt.Errorf("intermediate_size = %d is out of range: it must be between 1 and %d for mixtral's experts (moe.MaxIntermediate)", *r.IntermediateSize, MaxIntermediate)
		}
		c.Intermediate = orDefault(r.IntermediateSize, d.intermediate)
	} else {
		c.Intermediate = orDefault(r.MoEIntermediateSize, d.intermediate)
	}
	if r.NormTopKProb != nil {
		c.NormTopKProb = *r.NormTopKProb
	}
	return c, d, nil
}

// experts returns the routed expert count field of family fam: its own field
// first, then the aliases; nil when all are absent.
func (r *rawConfig) experts(fam Family) *int {
	switch {
	case (fam == Qwen2MoE || fam == Qwen3MoE) && r.NumExperts != nil:
		return r.NumExperts
	case fam == Mixtral && r.NumLocalExperts != nil:
		return r.NumLocalExperts
	}
	for _, p := range []*int{r.NRoutedExperts, r.NumExperts, r.NumLocalExperts} { // ranges checked by checkRawRanges
		if p != nil {
			return p
		}
	}
	return nil
}

// deepseek sets the fields of a DeepSeek-V2 or V3 Config: the shared
// experts, the scaling, the layer pattern and the routing.
func (r *rawConfig) deepseek(c *Config, d defaults) error {
	nShared := orDefault(r.NSharedExperts, d.nShared)
	if nShared < 0 {
		return fmt.Errorf("n_shared_experts = %d: must be >= 0", nShared)
	}
	c.SharedIntermediate = nShared * c.Intermediate
	c.RoutedScalingFactor = d.scale
	if r.RoutedScalingFactor != nil {
		c.RoutedScalingFactor = *r.RoutedScalingFactor
	}
	c.FirstKDenseReplace = orDefault(r.FirstKDenseReplace, d.firstKDense)
	c.MoELayerFreq = orDefault(r.MoELayerFreq, 1)
	var err error
	if c.Family == DeepseekV2 {
		err = r.deepseekV2Routing(c)
	} else {
		err = r.deepseekV3Routing(c)
	}
	if err != nil || c.TopKMethod == Greedy {
		return err
	}
	return r.groups(c, d)
}

// deepseekV2Routing sets DeepSeek-V2's scoring (softmax) and top-k method
// (greedy or group_limited_greedy).
func (r *rawConfig) deepseekV2Routing(c *Config) error {
	c.Scoring = Softmax
	if r.ScoringFunc != nil && *r.ScoringFunc != string(Softmax) {
		return fmt.Errorf("scoring_func = %q is not supported for deepseek_v2 (transformers' DeepseekV2Moe always uses softmax)", *r.ScoringFunc)
	}
	c.TopKMethod = Greedy
	if r.TopKMethod != nil {
		switch m := TopKMethod(*r.TopKMethod); m {
		case Greedy, GroupLimitedGreedy:
			c.TopKMethod = m
		default:
			return fmt.Errorf("topk_method = %q is not supported for deepseek_v2; want greedy or group_limited_greedy", *r.TopKMethod)
		}
	}
	if c.NormTopKProb {
		// DeepSeek's own modeling code renormalises when this is set, but
		// transformers' DeepseekV2Moe ignores it: refuse rather than pick one.
		return errors.New("norm_topk_prob = true is not supported for deepseek_v2: transformers' DeepseekV2Moe ignores it while DeepSeek's reference code renormalises; set it to false")
	}
	return nil
}

// deepseekV3Routing sets DeepSeek-V3's scoring (sigmoid) and top-k method
// (noaux_tc).
func (r *rawConfig) deepseekV3Routing(c *Config) error {
	c.Scoring = Sigmoid
	if r.ScoringFunc != nil && *r.ScoringFunc != string(Sigmoid) {
		return fmt.Errorf("scoring_func = %q is not supported for deepseek_v3 (transformers' DeepseekV3 router always uses sigmoid)", *r.ScoringFunc)
	}
	c.TopKMethod = NoAuxTC
	if r.TopKMethod != nil && *r.TopKMethod != string(NoAuxTC) {
		return fmt.Errorf("topk_method = %q is not supported for deepseek_v3 (transformers' DeepseekV3 router always uses noaux_tc)", *r.TopKMethod)
	}
	return nil
}

// groups sets n_group and topk_group for a grouped top-k method.
// DeepseekV2Config has no default for them (None); V3's are 8 and 4.
func (r *rawConfig) groups(c *Config, d defaults) error {
	switch {
	case r.NGroup != nil:
		c.NumGroups = *r.NGroup
	case d.nGroup != nil:
		c.NumGroups = *d.nGroup
	default:
		return fmt.Errorf("n_group is absent but topk_method = %s needs it", c.TopKMethod)
	}
	switch {
	case r.TopKGroup != nil:
		c.TopKGroups = *r.TopKGroup
	case d.topkGroup != nil:
		c.TopKGroups = *d.topkGroup
	default:
		return fmt.Errorf("topk_group is absent but topk_method = %s needs it", c.TopKMethod)
	}
	return nil
}

// qwen sets the fields of a Qwen2-MoE or Qwen3-MoE Config: the (gated)
// shared expert of Qwen2-MoE, the layer pattern, the scoring (softmax only).
func (r *rawConfig) qwen(c *Config, d defaults) error {
	if c.Family == Qwen2MoE {
		c.SharedIntermediate = orDefault(r.SharedExpertIntermediateSize, d.sharedIntermediate)
		c.SharedGate = c.SharedIntermediate > 0
	}
	c.DecoderSparseStep = orDefault(r.DecoderSparseStep, 1)
	if len(r.MLPOnlyLayers) > 0 {
		c.MLPOnlyLayers = append([]int(nil), r.MLPOnlyLayers...)
	}
	if r.ScoringFunc != nil && *r.ScoringFunc != string(Softmax) {
		return fmt.Errorf("scoring_func = %q is not supported for %s (softmax only)", *r.ScoringFunc, c.Family)
	}
	return nil
}

// jsonError turns an encoding/json error on config.json into one that says
// what is wrong: a syntax error (with its byte offset), or a field of the wrong
// type (named, with the type expected).
func jsonError(err error) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		got := te.Value
		switch {
		case strings.HasPrefix(got, "number "):
			got = "the " + got
		case got == "number":
			got = "a number out of range"
		case got == "string":
			got = "a string"
		case got == "bool":
			got = "a boolean"
		case got == "array":
			got = "a list"
		case got == "object":
			got = "an object"
		}
		field := te.Field
		if field == "" {
			field = "the top level"
		}
		return fmt.Errorf("config.json field %s is %s, expected %s; fix the value in config.json", field, got, describeType(te.Type))
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Errorf("config.json is not valid JSON: %v (at byte %d)", err, se.Offset)
	}
	return fmt.Errorf("config.json is not valid JSON: %w", err)
}

func describeType(t reflect.Type) string {
	if t == nil {
		return "another type"
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Int, reflect.Int64, reflect.Int32:
		return "an integer"
	case reflect.Float64, reflect.Float32:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Slice:
		return "a list of " + strings.TrimPrefix(strings.TrimPrefix(describeType(t.Elem()), "an "), "a ") + "s"
	case reflect.Struct, reflect.Map:
		return "a JSON object"
	}
	return t.String()
}

// checkRawRanges checks every size and layer field of config.json against the
// package's hard limits before anything is derived from them, naming the field
// as the file spells it.
func checkRawRanges(r *rawConfig) error {
	check := func(name string, p *int, lo, hi int, why string) error {
		if p == nil || (*p >= lo && *p <= hi) {
			return nil
		}
		return fmt.Errorf("%s = %d is out of range: it must be between %d and %d (%s)", name, *p, lo, hi, why)
	}
	for _, f := range []struct {
		name   string
		p      *int
		lo, hi int
		why    string
	}{
		{"hidden_size", r.HiddenSize, 1, MaxHiddenSize, "moe.MaxHiddenSize"},
		{"n_routed_experts", r.NRoutedExperts, 1, MaxExperts, fmt.Sprintf("the MoE kernels support at most %d routed experts, moe.MaxExperts", MaxExperts)},
		{"num_experts", r.NumExperts, 1, MaxExperts, fmt.Sprintf("the MoE kernels support at most %d routed experts, moe.MaxExperts", MaxExperts)},
		{"num_local_experts", r.NumLocalExperts, 1, MaxExperts, fmt.Sprintf("the MoE kernels support at most %d routed experts, moe.MaxExperts", MaxExperts)},
		{"num_experts_per_tok", r.NumExpertsPerTok, 1, MaxTopK, fmt.Sprintf("the MoE kernels support at most top-%d, moe.MaxTopK", MaxTopK)},
		{"moe_intermediate_size", r.MoEIntermediateSize, 1, MaxIntermediate, "moe.MaxIntermediate"},
		{"intermediate_size", r.IntermediateSize, 1, 1 << 20, "an MLP wider than 1048576"},
		{"n_shared_experts", r.NSharedExperts, 0, MaxSharedExperts, "moe.MaxSharedExperts"},
		{"shared_expert_intermediate_size", r.SharedExpertIntermediateSize, 0, MaxIntermediate, "moe.MaxIntermediate"},
		{"n_group", r.NGroup, 1, MaxExperts, "groups of experts, at most moe.MaxExperts"},
		{"topk_group", r.TopKGroup, 1, MaxExperts, "groups of experts, at most moe.MaxExperts"},
		{"num_hidden_layers", r.NumHiddenLayers, 0, MaxLayers, "moe.MaxLayers"},
		{"first_k_dense_replace", r.FirstKDenseReplace, 0, MaxLayers, "a layer index, at most moe.MaxLayers"},
		{"moe_layer_freq", r.MoELayerFreq, 1, MaxLayers, "a layer period, at most moe.MaxLayers"},
		{"decoder_sparse_step", r.DecoderSparseStep, 1, MaxLayers, "a layer period, at most moe.MaxLayers"},
	} {
		if err := check(f.name, f.p, f.lo, f.hi, f.why); err != nil {
			return err
		}
	}
	if len(r.MLPOnlyLayers) > MaxLayers {
		return fmt.Errorf("mlp_only_layers lists %d layers, more than moe.MaxLayers = %d", len(r.MLPOnlyLayers), MaxLayers)
	}
	for _, l := range r.MLPOnlyLayers {
		if l < 0 || l >= MaxLayers {
			return fmt.Errorf("mlp_only_layers holds layer %d: layer indices must be between 0 and %d", l, MaxLayers-1)
		}
	}
	if f := r.RoutedScalingFactor; f != nil && !(*f > 0 && *f < 1e6) {
		return fmt.Errorf("routed_scaling_factor = %v: must be a positive number below 1e6", *f)
	}
	return nil
}

// Validate checks that c describes a layer this package can run. It returns an
// error naming the first bad field and its value.
func (c *Config) Validate() error {
	if c == nil {
		return errors.New("moe: nil *Config")
	}
	if _, ok := familyDefaults[c.Family]; !ok {
		return fmt.Errorf("model_type %q is not supported", c.Family)
	}
	if err := c.checkSizes(); err != nil {
		return err
	}
	if c.HiddenAct != "silu" {
		return fmt.Errorf("hidden_act = %q is not supported; only silu is", c.HiddenAct)
	}
	if c.TopK > c.NumExperts {
		return fmt.Errorf("num_experts_per_tok = %d exceeds the %d experts", c.TopK, c.NumExperts)
	}
	if c.SharedIntermediate < 0 {
		return fmt.Errorf("shared expert intermediate size = %d: must be >= 0", c.SharedIntermediate)
	}
	if c.SharedGate && c.SharedIntermediate == 0 {
		return errors.New("shared_expert_gate set but the shared expert intermediate size is 0")
	}
	if c.NumHiddenLayers < 0 || c.FirstKDenseReplace < 0 {
		return fmt.Errorf("num_hidden_layers = %d, first_k_dense_replace = %d: must be >= 0", c.NumHiddenLayers, c.FirstKDenseReplace)
	}
	if math.IsNaN(c.RoutedScalingFactor) || math.IsInf(c.RoutedScalingFactor, 0) {
		return fmt.Errorf("routed_scaling_factor = %v: must be finite", c.RoutedScalingFactor)
	}
	return c.checkRouting()
}

// checkSizes checks the sizes that must be positive and those with a hard
// limit, and the layer indices of mlp_only_layers.
func (c *Config) checkSizes() error {
	pos := []struct {
		name string
		v    int
	}{
		{"hidden_size", c.HiddenSize}, {"num_experts", c.NumExperts}, {"num_experts_per_tok", c.TopK},
		{"moe_intermediate_size", c.Intermediate}, {"n_group", c.NumGroups}, {"topk_group", c.TopKGroups},
		{"moe_layer_freq", c.MoELayerFreq}, {"decoder_sparse_step", c.DecoderSparseStep},
	}
	for _, f := range pos {
		if f.v <= 0 {
			return fmt.Errorf("%s = %d: must be positive", f.name, f.v)
		}
	}
	caps := []struct {
		name string
		v    int
		max  int
	}{
		// The expert count is bounded loosely here (RandomWeights and the CPU
		// reference handle more); ParseConfig and NewLayer enforce the kernels'
		// MaxExperts and MaxTopK.
		{"hidden_size", c.HiddenSize, MaxHiddenSize}, {"num_experts", c.NumExperts, 8 * MaxExperts},
		{"moe_intermediate_size", c.Intermediate, MaxIntermediate}, {"shared expert intermediate size", c.SharedIntermediate, MaxIntermediate},
		{"n_group", c.NumGroups, MaxExperts}, {"topk_group", c.TopKGroups, MaxExperts},
		{"num_hidden_layers", c.NumHiddenLayers, MaxLayers}, {"first_k_dense_replace", c.FirstKDenseReplace, MaxLayers},
		{"moe_layer_freq", c.MoELayerFreq, MaxLayers}, {"decoder_sparse_step", c.DecoderSparseStep, MaxLayers},
		{"len(mlp_only_layers)", len(c.MLPOnlyLayers), MaxLayers},
	}
	for _, f := range caps {
		if f.v > f.max {
			return fmt.Errorf("%s = %d is out of range: at most %d is supported", f.name, f.v, f.max)
		}
	}
	for _, l := range c.MLPOnlyLayers {
		if l < 0 || l >= MaxLayers {
			return fmt.Errorf("mlp_only_layers holds layer %d: layer indices must be between 0 and %d", l, MaxLayers-1)
		}
	}
	return nil
}

// checkRouting checks the scoring function, the top-k method and its groups.
func (c *Config) checkRouting() error {
	switch c.Scoring {
	case Softmax, Sigmoid:
	default:
		return fmt.Errorf("scoring_func = %q is not supported; want softmax or sigmoid", c.Scoring)
	}
	switch c.TopKMethod {
	case Greedy:
		return nil
	case GroupLimitedGreedy, NoAuxTC:
	default:
		return fmt.Errorf("topk_method = %q is not supported; want greedy, group_limited_greedy or noaux_tc", c.TopKMethod)
	}
	per := c.NumExperts / c.NumGroups
	switch {
	case c.NumExperts%c.NumGroups != 0:
		return fmt.Errorf("n_group = %d does not divide the %d experts", c.NumGroups, c.NumExperts)
	case c.TopKGroups > c.NumGroups:
		return fmt.Errorf("topk_group = %d exceeds n_group = %d", c.TopKGroups, c.NumGroups)
	case c.TopKMethod == NoAuxTC && per < 2:
		return fmt.Errorf("n_group = %d leaves %d expert per group; noaux_tc needs at least 2 (it sums the top 2)", c.NumGroups, per)
	case c.TopK > c.TopKGroups*per:
		return fmt.Errorf("num_experts_per_tok = %d exceeds the %d experts in topk_group = %d groups", c.TopK, c.TopKGroups*per, c.TopKGroups)
	}
	return nil
}

// HasBias reports whether the router has an e_score_correction_bias (noaux_tc).
func (c *Config) HasBias() bool { return c.TopKMethod == NoAuxTC }

// CheckMoELayer returns nil when decoder layer `layer` is an MoE layer, and an
// error saying why not (out of range, or a dense MLP layer by the family's rule)
// otherwise.
func (c *Config) CheckMoELayer(layer int) error {
	if layer < 0 || (c.NumHiddenLayers > 0 && layer >= c.NumHiddenLayers) {
		return fmt.Errorf("layer %d is out of range: the model has num_hidden_layers = %d", layer, c.NumHiddenLayers)
	}
	switch c.Family {
	case DeepseekV2, DeepseekV3:
		if layer < c.FirstKDenseReplace {
			return fmt.Errorf("layer %d is a dense MLP layer, not MoE: first_k_dense_replace = %d; choose a layer >= %d", layer, c.FirstKDenseReplace, c.FirstKDenseReplace)
		}
		if layer%c.MoELayerFreq != 0 {
			return fmt.Errorf("layer %d is a dense MLP layer, not MoE: moe_layer_freq = %d; choose a multiple of it", layer, c.MoELayerFreq)
		}
	case Qwen2MoE, Qwen3MoE:
		if slices.Contains(c.MLPOnlyLayers, layer) {
			return fmt.Errorf("layer %d is a dense MLP layer, not MoE: it is listed in mlp_only_layers %v", layer, c.MLPOnlyLayers)
		}
		if (layer+1)%c.DecoderSparseStep != 0 {
			return fmt.Errorf("layer %d is a dense MLP layer, not MoE: decoder_sparse_step = %d needs (layer+1) divisible by it", layer, c.DecoderSparseStep)
		}
	}
	return nil
}

// FirstMoELayer returns the lowest MoE layer index, or an error when the model
// has none (below num_hidden_layers when it is known, else below MaxLayers). It
// computes the answer from the family's rule instead of scanning layers, so it
// ends at once for any Config, valid or not.
func (c *Config) FirstMoELayer() (int, error) {
	limit := MaxLayers
	if c.NumHiddenLayers > 0 {
		limit = min(c.NumHiddenLayers, MaxLayers)
	}
	first := -1
	switch c.Family {
	case DeepseekV2, DeepseekV3:
		k, f := c.FirstKDenseReplace, c.MoELayerFreq
		if k >= 0 && k < limit && f > 0 && f <= MaxLayers {
			first = (k + f - 1) / f * f // the first multiple of f >= k
		}
	case Qwen2MoE, Qwen3MoE:
		if step := c.DecoderSparseStep; step > 0 && step <= MaxLayers {
			dense := make(map[int]bool, len(c.MLPOnlyLayers))
			for _, l := range c.MLPOnlyLayers {
				dense[l] = true
			}
			// At most len(MLPOnlyLayers)+1 candidates: step-1, 2*step-1, ...
			for l := step - 1; l < limit; l += step {
				if !dense[l] {
					first = l
					break
				}
			}
		}
	default:
		first = 0
	}
	if first < 0 || first >= limit || c.CheckMoELayer(first) != nil {
		return 0, fmt.Errorf("the model has no MoE layer among its first %d layers", limit)
	}
	return first, nil
}

// CheckTokens checks that a batch of T tokens is one the layer can run: T >= 1,
// and small enough for the MoE kernels' 32-bit index arithmetic: T*K and T
// times the widest activation row must fit in an int32, and so must what
// moekernels.CheckLimits bounds (the sorted rows of T*(K + the fused shared
// expert's chunks) assignments, T*H, and one expert's 2*I*H weights). Call it
// on the input's shape before decoding or allocating it.
func (c *Config) CheckTokens(T int) error {
	if T <= 0 {
		return fmt.Errorf("the input has no tokens (T = %d); pass activations shaped [tokens, %d] with at least one token", T, c.HiddenSize)
	}
	row := max(c.HiddenSize, 2*c.Intermediate, 2*c.SharedIntermediate, c.NumExperts, 1)
	maxT := math.MaxInt32 / row
	if c.TopK > 0 {
		maxT = min(maxT, math.MaxInt32/c.TopK)
	}
	if T > maxT {
		return fmt.Errorf("a batch of %d tokens is too many for the MoE kernels' 32-bit index arithmetic (at most %d tokens for this model); split the batch", T, maxT)
	}
	ns := c.fusedSharedChunks()
	return moekernels.CheckLimits(T, c.TopK+ns, c.NumExperts+ns, c.HiddenSize, c.Intermediate)
}

// fusedSharedChunks returns the chunks of Intermediate width the shared
// expert becomes in FusedShared mode (routing slots K.. of every token, the
// experts after the routed ones), or 0 when it cannot run fused.
func (c *Config) fusedSharedChunks() int {
	Is, I := c.SharedIntermediate, c.Intermediate
	if Is <= 0 || I <= 0 || c.SharedGate || Is%I != 0 || Is/I > MaxTopK {
		return 0
	}
	return Is / I
}

// HFConfig returns a Hugging Face config.json for c: the fields of c's family
// that ParseConfig reads (model_type, sizes, routing, the layer pattern), so
// that ParseConfig(HFConfig()) gives c back, with c.Quant as its
// quantization_config (fp8.WithQuantConfig) when set. It fails on a Config that no
// config.json of its family can describe: DeepSeek's shared width not a
// multiple of the routed one, a shared expert on qwen3_moe or mixtral, a
// Qwen2-MoE shared expert without its gate (or the reverse).
func (c *Config) HFConfig() ([]byte, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	m := map[string]any{
		"model_type":          string(c.Family),
		"hidden_size":         c.HiddenSize,
		"num_experts_per_tok": c.TopK,
		"norm_topk_prob":      c.NormTopKProb,
		"hidden_act":          c.HiddenAct,
		"num_hidden_layers":   c.NumHiddenLayers,
	}
	noShared := func() error {
		if c.SharedIntermediate != 0 || c.SharedGate {
			return fmt.Errorf("moe: HFConfig: %s has no shared expert, this Config has one %d wide", c.Family, c.SharedIntermediate)
		}
		return nil
	}
	switch c.Family {
	case DeepseekV2, DeepseekV3:
		if c.SharedIntermediate%c.Intermediate != 0 || c.SharedGate {
			return nil, fmt.Errorf("moe: HFConfig: %s describes its shared expert as n_shared_experts x moe_intermediate_size (%d), not %d wide%s",
				c.Family, c.Intermediate, c.SharedIntermediate, map[bool]string{true: " behind a gate", false: ""}[c.SharedGate])
		}
		m["n_routed_experts"] = c.NumExperts
		m["moe_intermediate_size"] = c.Intermediate
		m["n_shared_experts"] = c.SharedIntermediate / c.Intermediate
		m["routed_scaling_factor"] = c.RoutedScalingFactor
		m["first_k_dense_replace"] = c.FirstKDenseReplace
		m["moe_layer_freq"] = c.MoELayerFreq
		m["scoring_func"] = string(c.Scoring)
		m["topk_method"] = string(c.TopKMethod)
		if c.TopKMethod != Greedy {
			m["n_group"], m["topk_group"] = c.NumGroups, c.TopKGroups
		}
	case Qwen2MoE, Qwen3MoE:
		m["num_experts"] = c.NumExperts
		m["moe_intermediate_size"] = c.Intermediate
		m["decoder_sparse_step"] = c.DecoderSparseStep
		if len(c.MLPOnlyLayers) > 0 {
			m["mlp_only_layers"] = c.MLPOnlyLayers
		}
		if c.Family == Qwen2MoE {
			if c.SharedGate != (c.SharedIntermediate > 0) {
				return nil, fmt.Errorf("moe: HFConfig: qwen2_moe's shared expert (%d wide) always has its gate: SharedGate must be %v", c.SharedIntermediate, c.SharedIntermediate > 0)
			}
			m["shared_expert_intermediate_size"] = c.SharedIntermediate
		} else if err := noShared(); err != nil {
			return nil, err
		}
	case Mixtral:
		if err := noShared(); err != nil {
			return nil, err
		}
		m["num_local_experts"] = c.NumExperts
		m["intermediate_size"] = c.Intermediate
	}
	out, err := json.MarshalIndent(m, "", "  ")
	if err != nil || c.Quant == nil {
		return out, err
	}
	return fp8.WithQuantConfig(out, c.Quant)
}
