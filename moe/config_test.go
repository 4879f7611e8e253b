package moe

import (
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestParseConfigDefaults(t *testing.T) {
	cases := []struct {
		name string
		json string
		want Config
	}{
		{
			// DeepseekV2Config defaults, num_experts_per_tok given (it has none).
			"deepseek_v2 defaults", `{"model_type":"deepseek_v2","num_experts_per_tok":6}`,
			Config{Family: DeepseekV2, HiddenSize: 4096, NumExperts: 64, TopK: 6, Intermediate: 1407,
				SharedIntermediate: 2 * 1407, Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1,
				RoutedScalingFactor: 1, HiddenAct: "silu", NumHiddenLayers: 32, MoELayerFreq: 1, DecoderSparseStep: 1},
		},
		{
			"deepseek_v3 defaults", `{"model_type":"deepseek_v3"}`,
			Config{Family: DeepseekV3, HiddenSize: 7168, NumExperts: 256, TopK: 8, Intermediate: 2048,
				SharedIntermediate: 2048, Scoring: Sigmoid, TopKMethod: NoAuxTC, NumGroups: 8, TopKGroups: 4,
				NormTopKProb: true, RoutedScalingFactor: 2.5, HiddenAct: "silu", NumHiddenLayers: 61,
				FirstKDenseReplace: 3, MoELayerFreq: 1, DecoderSparseStep: 1},
		},
		{
			"qwen2_moe defaults", `{"model_type":"qwen2_moe"}`,
			Config{Family: Qwen2MoE, HiddenSize: 2048, NumExperts: 60, TopK: 4, Intermediate: 1408,
				SharedIntermediate: 5632, SharedGate: true, Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1,
				TopKGroups: 1, RoutedScalingFactor: 1, HiddenAct: "silu", NumHiddenLayers: 24, MoELayerFreq: 1,
				DecoderSparseStep: 1},
		},
		{
			"qwen3_moe defaults", `{"model_type":"qwen3_moe"}`,
			Config{Family: Qwen3MoE, HiddenSize: 2048, NumExperts: 128, TopK: 8, Intermediate: 768,
				Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1, RoutedScalingFactor: 1,
				HiddenAct: "silu", NumHiddenLayers: 24, MoELayerFreq: 1, DecoderSparseStep: 1},
		},
		{
			"mixtral defaults", `{"model_type":"mixtral"}`,
			Config{Family: Mixtral, HiddenSize: 4096, NumExperts: 8, TopK: 2, Intermediate: 14336,
				Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1, NormTopKProb: true,
				RoutedScalingFactor: 1, HiddenAct: "silu", NumHiddenLayers: 32, MoELayerFreq: 1, DecoderSparseStep: 1},
		},
		{
			// The real DeepSeek-V2-Lite config.json fields.
			"deepseek-v2-lite config.json",
			`{"model_type":"deepseek_v2","hidden_size":2048,"n_routed_experts":64,"num_experts_per_tok":6,
			  "moe_intermediate_size":1408,"n_shared_experts":2,"scoring_func":"softmax","topk_method":"greedy",
			  "n_group":1,"topk_group":1,"norm_topk_prob":false,"routed_scaling_factor":1.0,"hidden_act":"silu",
			  "num_hidden_layers":27,"first_k_dense_replace":1,"moe_layer_freq":1,"intermediate_size":10944}`,
			*DeepseekV2Lite(),
		},
		{
			"deepseek-v3 config.json",
			`{"model_type":"deepseek_v3","hidden_size":7168,"n_routed_experts":256,"num_experts_per_tok":8,
			  "moe_intermediate_size":2048,"n_shared_experts":1,"scoring_func":"sigmoid","topk_method":"noaux_tc",
			  "n_group":8,"topk_group":4,"norm_topk_prob":true,"routed_scaling_factor":2.5,"hidden_act":"silu",
			  "num_hidden_layers":61,"first_k_dense_replace":3,"moe_layer_freq":1}`,
			*DeepseekV3Preset(),
		},
		{
			"qwen1.5-moe config.json",
			`{"model_type":"qwen2_moe","hidden_size":2048,"num_experts":60,"num_experts_per_tok":4,
			  "moe_intermediate_size":1408,"shared_expert_intermediate_size":5632,"norm_topk_prob":false,
			  "num_hidden_layers":24,"decoder_sparse_step":1,"mlp_only_layers":[],"hidden_act":"silu"}`,
			*Qwen15MoE(),
		},
		{
			"qwen3-30b-a3b config.json",
			`{"model_type":"qwen3_moe","hidden_size":2048,"num_experts":128,"num_experts_per_tok":8,
			  "moe_intermediate_size":768,"norm_topk_prob":true,"num_hidden_layers":48,"decoder_sparse_step":1,
			  "mlp_only_layers":[],"hidden_act":"silu"}`,
			*Qwen3_30B_A3B(),
		},
		{
			"alias num_local_experts for deepseek", `{"model_type":"deepseek_v2","num_local_experts":16,"num_experts_per_tok":2,"hidden_size":64,"moe_intermediate_size":32,"topk_method":"group_limited_greedy","n_group":4,"topk_group":2}`,
			Config{Family: DeepseekV2, HiddenSize: 64, NumExperts: 16, TopK: 2, Intermediate: 32,
				SharedIntermediate: 64, Scoring: Softmax, TopKMethod: GroupLimitedGreedy, NumGroups: 4, TopKGroups: 2,
				RoutedScalingFactor: 1, HiddenAct: "silu", NumHiddenLayers: 32, MoELayerFreq: 1, DecoderSparseStep: 1},
		},
		{
			"qwen2 without shared expert", `{"model_type":"qwen2_moe","shared_expert_intermediate_size":0}`,
			Config{Family: Qwen2MoE, HiddenSize: 2048, NumExperts: 60, TopK: 4, Intermediate: 1408,
				Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1, RoutedScalingFactor: 1,
				HiddenAct: "silu", NumHiddenLayers: 24, MoELayerFreq: 1, DecoderSparseStep: 1},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParseConfig([]byte(c.json))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(*got, c.want) {
				t.Fatalf("got  %+v\nwant %+v", *got, c.want)
			}
		})
	}
}

func TestParseConfigErrors(t *testing.T) {
	cases := []struct {
		name, json, want string
	}{
		{"not json", `{`, "not valid JSON"},
		{"no model_type", `{}`, "no model_type"},
		{"unknown family", `{"model_type":"llama"}`, `model_type "llama"`},
		{"gelu", `{"model_type":"qwen3_moe","hidden_act":"gelu"}`, `hidden_act = "gelu"`},
		{"v2 sigmoid", `{"model_type":"deepseek_v2","num_experts_per_tok":2,"scoring_func":"sigmoid"}`, `scoring_func = "sigmoid"`},
		{"v2 noaux", `{"model_type":"deepseek_v2","num_experts_per_tok":2,"topk_method":"noaux_tc"}`, `topk_method = "noaux_tc"`},
		{"v2 norm", `{"model_type":"deepseek_v2","num_experts_per_tok":2,"norm_topk_prob":true}`, "norm_topk_prob = true"},
		{"v2 no topk", `{"model_type":"deepseek_v2"}`, "num_experts_per_tok is absent"},
		{"v2 group no n_group", `{"model_type":"deepseek_v2","num_experts_per_tok":2,"topk_method":"group_limited_greedy","topk_group":1}`, "n_group is absent"},
		{"v2 group no topk_group", `{"model_type":"deepseek_v2","num_experts_per_tok":2,"topk_method":"group_limited_greedy","n_group":8}`, "topk_group is absent"},
		{"v3 softmax", `{"model_type":"deepseek_v3","scoring_func":"softmax"}`, `scoring_func = "softmax"`},
		{"v3 greedy", `{"model_type":"deepseek_v3","topk_method":"greedy"}`, `topk_method = "greedy"`},
		{"qwen sigmoid", `{"model_type":"qwen2_moe","scoring_func":"sigmoid"}`, `scoring_func = "sigmoid"`},
		{"mixtral no norm", `{"model_type":"mixtral","norm_topk_prob":false}`, "norm_topk_prob = false"},
		{"groups not dividing", `{"model_type":"deepseek_v3","n_group":7}`, "n_group = 7 does not divide"},
		{"topk_group too big", `{"model_type":"deepseek_v3","topk_group":9}`, "topk_group = 9 exceeds"},
		{"one expert per group", `{"model_type":"deepseek_v3","n_routed_experts":8,"n_group":8,"topk_group":4,"num_experts_per_tok":2}`, "at least 2"},
		{"k too big for groups", `{"model_type":"deepseek_v3","n_routed_experts":16,"n_group":4,"topk_group":1,"num_experts_per_tok":5}`, "exceeds the 4 experts"},
		{"k > E", `{"model_type":"qwen3_moe","num_experts":4,"num_experts_per_tok":5}`, "num_experts_per_tok = 5 exceeds"},
		{"zero hidden", `{"model_type":"qwen3_moe","hidden_size":0}`, "hidden_size = 0"},
		{"negative shared", `{"model_type":"deepseek_v3","n_shared_experts":-1}`, "n_shared_experts = -1"},
		{"zero sparse step", `{"model_type":"qwen3_moe","decoder_sparse_step":0}`, "decoder_sparse_step = 0"},
		{"wrong type", `{"model_type":"qwen3_moe","hidden_size":"big"}`, "hidden_size is a string, expected an integer"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(c.json))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to contain %q", err, c.want)
			}
		})
	}
}

func TestCheckMoELayer(t *testing.T) {
	v2 := DeepseekV2Lite()
	v2freq := DeepseekV2Lite()
	v2freq.MoELayerFreq = 2
	q := Qwen15MoE()
	q.DecoderSparseStep = 2
	q.MLPOnlyLayers = []int{3}
	cases := []struct {
		name  string
		cfg   *Config
		layer int
		want  string // "" = MoE
	}{
		{"v2 layer 0 dense", v2, 0, "first_k_dense_replace = 1"},
		{"v2 layer 1 moe", v2, 1, ""},
		{"v2 layer 26 moe", v2, 26, ""},
		{"v2 layer 27 out of range", v2, 27, "out of range"},
		{"negative", v2, -1, "out of range"},
		{"v2 freq odd", v2freq, 3, "moe_layer_freq = 2"},
		{"v2 freq even", v2freq, 4, ""},
		{"v3 layer 2 dense", DeepseekV3Preset(), 2, "first_k_dense_replace = 3"},
		{"qwen step even layer", q, 0, "decoder_sparse_step = 2"},
		{"qwen step odd layer", q, 1, ""},
		{"qwen mlp only", q, 3, "mlp_only_layers"},
		{"qwen 5", q, 5, ""},
		{"mixtral", &Config{Family: Mixtral, NumHiddenLayers: 4}, 3, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.cfg.CheckMoELayer(c.layer)
			if c.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want %q", err, c.want)
			}
		})
	}
	if l, err := v2.FirstMoELayer(); err != nil || l != 1 {
		t.Fatalf("FirstMoELayer = %d, %v; want 1", l, err)
	}
	if l, err := q.FirstMoELayer(); err != nil || l != 1 {
		t.Fatalf("qwen FirstMoELayer = %d, %v; want 1", l, err)
	}
	dense := DeepseekV2Lite()
	dense.FirstKDenseReplace = 27
	if _, err := dense.FirstMoELayer(); err == nil {
		t.Fatal("all-dense model: want error")
	}
}

func TestPresets(t *testing.T) {
	for _, name := range PresetNames() {
		t.Run(name, func(t *testing.T) {
			c, err := Preset(name)
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			c.HiddenSize = 1 // each call returns a fresh copy
			if d, _ := Preset(name); d.HiddenSize == 1 {
				t.Fatal("Preset returned shared state")
			}
		})
	}
	if _, err := Preset("gpt-5"); err == nil || !strings.Contains(err.Error(), "deepseek-v2-lite") {
		t.Fatalf("unknown preset: err = %v", err)
	}
}

func TestLoadConfigFile(t *testing.T) {
	dir := t.TempDir()
	if _, err := LoadConfig(dir); err == nil {
		t.Fatal("missing config.json: want error")
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"model_type":"qwen3_moe","hidden_act":"relu"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := LoadConfig(dir)
	if err == nil || !strings.Contains(err.Error(), `hidden_act = "relu"`) || !strings.Contains(err.Error(), "config.json") {
		t.Fatalf("err = %v", err)
	}
}

// TestHFConfigRoundTrip checks that HFConfig writes a config.json ParseConfig
// reads back to the same Config, for every preset, the scaled presets and the
// test variants of each family, and that it refuses Configs no config.json of
// their family can describe.
func TestHFConfigRoundTrip(t *testing.T) {
	cases := map[string]*Config{}
	for _, name := range PresetNames() {
		c, err := Preset(name)
		if err != nil {
			t.Fatal(err)
		}
		cases["preset "+name] = c
	}
	for name, c := range scaledPresets() {
		cases["scaled "+name] = c
	}
	for name, c := range variants() {
		cases["variant "+name] = c
	}
	q := Qwen3_30B_A3B()
	q.DecoderSparseStep, q.MLPOnlyLayers = 2, []int{1, 5}
	cases["qwen3 sparse step and dense layers"] = q
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			js, err := c.HFConfig()
			if err != nil {
				t.Fatal(err)
			}
			got, err := ParseConfig(js)
			if err != nil {
				t.Fatalf("ParseConfig(HFConfig()): %v\n%s", err, js)
			}
			if !reflect.DeepEqual(got, c) {
				t.Errorf("round trip changed the Config:\n got %+v\nwant %+v\n%s", *got, *c, js)
			}
		})
	}
	for _, tc := range []struct {
		name string
		edit func(c *Config)
		want string
	}{
		{"deepseek shared not a multiple", func(c *Config) { c.Family = DeepseekV2; c.SharedIntermediate = c.Intermediate + 8 }, "n_shared_experts x moe_intermediate_size"},
		{"qwen3 with a shared expert", func(c *Config) { c.Family = Qwen3MoE; c.SharedIntermediate = c.Intermediate }, "has no shared expert"},
		{"qwen2 shared without gate", func(c *Config) { c.Family = Qwen2MoE; c.SharedIntermediate, c.SharedGate = 64, false }, "always has its gate"},
	} {
		c := DeepseekV2Lite()
		tc.edit(c)
		if _, err := c.HFConfig(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: HFConfig error %v, want one containing %q", tc.name, err, tc.want)
		}
	}
}

// TestCheckTokensLimits checks CheckTokens against the MoE kernels' 32-bit
// limits (issue 20): the batches past 2^31 sorted-row elements that the
// 64-bit down-kernel offsets now allow, and the limits that stay 32-bit.
func TestCheckTokensLimits(t *testing.T) {
	dsv3 := DeepseekV3Preset()
	// Small rows, and 16 routed slots plus a fused shared chunk per token:
	// T*(K+1) passes 2^31 while T*K and T times every row width do not.
	tiny := &Config{Family: DeepseekV2, HiddenSize: 8, NumExperts: 16, TopK: 16, Intermediate: 8,
		SharedIntermediate: 8, Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1,
		RoutedScalingFactor: 1, HiddenAct: "silu", MoELayerFreq: 1, DecoderSparseStep: 1}
	tinyT := math.MaxInt32 / 16
	// One expert's gate and up weights, 2*I*H elements, past 2^31.
	wide := *dsv3
	wide.HiddenSize, wide.Intermediate, wide.SharedIntermediate = 1<<16, 1<<15, 1<<15
	for _, tc := range []struct {
		name string
		cfg  *Config
		T    int
		want string // "" for nil
	}{
		// T*K*I = 2^31 + ...: the down kernel's rows of act, 64-bit now.
		{"deepseek-v3 past T*K*I = 2^31", dsv3, 140_000, ""},
		{"deepseek-v3 at the row limit", dsv3, math.MaxInt32 / 7168, ""},
		{"deepseek-v3 past the row limit", dsv3, math.MaxInt32/7168 + 1, "32-bit"},
		{"tiny under the sorted-row limit", tiny, 126_000_000, ""},
		{"fused shared slots past 2^31", tiny, tinyT, "sorted rows"},
		{"expert weights past 2^31", &wide, 1, "2*I*H"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.CheckTokens(tc.T)
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Errorf("CheckTokens(%d) = %v, want %q", tc.T, err, tc.want)
			}
		})
	}
}
