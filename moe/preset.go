package moe

import (
	"fmt"
	"sort"
	"strings"
)

// DeepseekV2Lite returns the MoE layer of deepseek-ai/DeepSeek-V2-Lite: hidden
// 2048, 64 experts, top-6, expert intermediate 1408, 2 shared experts (2816
// wide), softmax, greedy, no renormalisation, routed_scaling_factor 1.0, 27
// layers of which layer 0 is dense. Each call returns a new Config.
func DeepseekV2Lite() *Config {
	return &Config{
		Family: DeepseekV2, HiddenSize: 2048, NumExperts: 64, TopK: 6, Intermediate: 1408,
		SharedIntermediate: 2 * 1408, Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1,
		NormTopKProb: false, RoutedScalingFactor: 1.0, HiddenAct: "silu",
		NumHiddenLayers: 27, FirstKDenseReplace: 1, MoELayerFreq: 1, DecoderSparseStep: 1,
	}
}

// DeepseekV3Preset returns the MoE layer of deepseek-ai/DeepSeek-V3: hidden 7168,
// 256 experts, top-8, expert intermediate 2048, 1 shared expert, sigmoid scores,
// noaux_tc with 8 groups of which 4 are kept, renormalised, scaled by 2.5, 61
// layers of which the first 3 are dense. Each call returns a new Config.
func DeepseekV3Preset() *Config {
	return &Config{
		Family: DeepseekV3, HiddenSize: 7168, NumExperts: 256, TopK: 8, Intermediate: 2048,
		SharedIntermediate: 2048, Scoring: Sigmoid, TopKMethod: NoAuxTC, NumGroups: 8, TopKGroups: 4,
		NormTopKProb: true, RoutedScalingFactor: 2.5, HiddenAct: "silu",
		NumHiddenLayers: 61, FirstKDenseReplace: 3, MoELayerFreq: 1, DecoderSparseStep: 1,
	}
}

// Qwen15MoE returns the MoE layer of Qwen/Qwen1.5-MoE-A2.7B (model_type
// qwen2_moe): hidden 2048, 60 experts, top-4, expert intermediate 1408, a shared
// expert 5632 wide behind a sigmoid gate, softmax over all experts, no
// renormalisation, 24 layers, all MoE. Each call returns a new Config.
func Qwen15MoE() *Config {
	return &Config{
		Family: Qwen2MoE, HiddenSize: 2048, NumExperts: 60, TopK: 4, Intermediate: 1408,
		SharedIntermediate: 5632, SharedGate: true, Scoring: Softmax, TopKMethod: Greedy,
		NumGroups: 1, TopKGroups: 1, NormTopKProb: false, RoutedScalingFactor: 1, HiddenAct: "silu",
		NumHiddenLayers: 24, MoELayerFreq: 1, DecoderSparseStep: 1,
	}
}

// Qwen3_30B_A3B returns the MoE layer of Qwen/Qwen3-30B-A3B: hidden 2048, 128
// experts, top-8, expert intermediate 768, no shared expert, softmax then
// renormalised top-k, 48 layers, all MoE. Each call returns a new Config.
func Qwen3_30B_A3B() *Config {
	return &Config{
		Family: Qwen3MoE, HiddenSize: 2048, NumExperts: 128, TopK: 8, Intermediate: 768,
		Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1,
		NormTopKProb: true, RoutedScalingFactor: 1, HiddenAct: "silu",
		NumHiddenLayers: 48, MoELayerFreq: 1, DecoderSparseStep: 1,
	}
}

var presets = map[string]func() *Config{
	"deepseek-v2-lite": DeepseekV2Lite,
	"deepseek-v3":      DeepseekV3Preset,
	"qwen1.5-moe":      Qwen15MoE,
	"qwen3-30b-a3b":    Qwen3_30B_A3B,
}

// PresetNames lists the names Preset accepts, sorted.
func PresetNames() []string {
	names := make([]string, 0, len(presets))
	for n := range presets {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Preset returns a new Config for a named preset (see PresetNames).
func Preset(name string) (*Config, error) {
	f, ok := presets[name]
	if !ok {
		return nil, fmt.Errorf("moe.Preset: unknown preset %q; want one of %s", name, strings.Join(PresetNames(), ", "))
	}
	return f(), nil
}
