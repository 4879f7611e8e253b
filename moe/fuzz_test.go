package moe

import (
	"path/filepath"
	"testing"
)

// FuzzIndex: parseIndex never panics, and every shard it accepts is a plain
// file name inside the model directory.
func FuzzIndex(f *testing.F) {
	f.Add([]byte(`{"metadata":{"total_size":8},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}`))
	f.Add([]byte(`{"weight_map":{"a":".."}}`))
	f.Add([]byte(`{"weight_map":{"a":"x.safetensors","a":"y.safetensors"}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		wm, err := parseIndex(data)
		if err != nil {
			return
		}
		for name, shard := range wm {
			if !validShardName(shard) || filepath.Base(shard) != shard || shard == ".." || shard == "." {
				t.Fatalf("tensor %q: shard %q accepted", name, shard)
			}
		}
	})
}

// FuzzConfig: ParseConfig never panics or hangs, and a Config it accepts is
// within the hard limits and answers FirstMoELayer and CheckTokens at once.
func FuzzConfig(f *testing.F) {
	f.Add([]byte(`{"model_type":"qwen3_moe","hidden_size":64,"num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":32,"num_hidden_layers":2}`))
	f.Add([]byte(`{"model_type":"deepseek_v3","first_k_dense_replace":1000000000000000}`))
	f.Add([]byte(`{"model_type":"qwen2_moe","decoder_sparse_step":3,"mlp_only_layers":[2,5],"num_hidden_layers":12}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("accepted config does not validate: %v", err)
		}
		if c.NumExperts > MaxExperts || c.TopK > MaxTopK || c.HiddenSize > MaxHiddenSize || c.Intermediate > MaxIntermediate ||
			c.SharedIntermediate > MaxIntermediate || c.NumHiddenLayers > MaxLayers {
			t.Fatalf("accepted config beyond the limits: %+v", c)
		}
		if l, err := c.FirstMoELayer(); err == nil {
			if err := c.CheckMoELayer(l); err != nil {
				t.Fatalf("FirstMoELayer = %d, but CheckMoELayer: %v", l, err)
			}
		} else if c.NumHiddenLayers > 0 {
			t.Fatalf("accepted config with no MoE layer: %v", err)
		}
		_ = c.CheckTokens(1)
		_ = c.CheckTokens(1 << 30)
	})
}
