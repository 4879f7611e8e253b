package fp8

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// deepseekV3Quant is the quantization_config of deepseek-ai/DeepSeek-V3's
// config.json.
const deepseekV3Quant = `{
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [
      128,
      128
    ]
  }`

func TestParseQuantConfig(t *testing.T) {
	hub := HubQuantConfig()
	withModules := HubQuantConfig()
	withModules.ModulesToNotConvert = []string{"lm_head"}
	for _, tc := range []struct {
		name string
		raw  string
		want *QuantConfig // nil: an error containing err
		err  string
	}{
		{"DeepSeek-V3", deepseekV3Quant, hub, ""},
		{"fmt and activation_scheme absent", `{"quant_method": "fp8", "weight_block_size": [128, 128]}`, hub, ""},
		{"modules_to_not_convert kept, other fields ignored", `{"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"], "dequantize": false}`, withModules, ""},
		{"unknown quant_method", `{"quant_method": "awq", "weight_block_size": [128, 128]}`, nil, `quant_method = "awq" is not supported; want "fp8"`},
		{"fbgemm_fp8", `{"quant_method": "fbgemm_fp8"}`, nil, `quant_method = "fbgemm_fp8" is not supported`},
		{"no quant_method", `{"fmt": "e4m3", "weight_block_size": [128, 128]}`, nil, "has no quant_method"},
		{"unknown fmt", `{"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}`, nil, `fmt = "e5m2" is not supported; want "e4m3"`},
		{"static activations", `{"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}`, nil, `activation_scheme = "static" is not supported; want "dynamic"`},
		{"block 64", `{"quant_method": "fp8", "weight_block_size": [64, 64]}`, nil, "weight_block_size = [64,64] is not supported; want [128, 128]"},
		{"block 128x64", `{"quant_method": "fp8", "weight_block_size": [128, 64]}`, nil, "weight_block_size = [128,64] is not supported"},
		{"block of three", `{"quant_method": "fp8", "weight_block_size": [128, 128, 1]}`, nil, "is not supported; want [128, 128]"},
		{"block not a list", `{"quant_method": "fp8", "weight_block_size": "128x128"}`, nil, `weight_block_size = "128x128" is not a list of two integers`},
		{"no block: per-tensor", `{"quant_method": "fp8", "activation_scheme": "dynamic"}`, nil, "no weight_block_size: per-tensor FP8 scales are not supported"},
		{"null block", `{"quant_method": "fp8", "weight_block_size": null}`, nil, "no weight_block_size"},
		{"quant_method a number", `{"quant_method": 8}`, nil, "quantization_config.quant_method is number"},
		{"not an object", `["fp8"]`, nil, "quantization_config is not a JSON object"},
		{"null", `null`, nil, "quantization_config is not a JSON object"},
		{"empty", ``, nil, "quantization_config is not a JSON object"},
		{"bad JSON", `{"quant_method": "fp8",}`, nil, "not valid JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseQuantConfig(json.RawMessage(tc.raw))
			if tc.want != nil {
				if err != nil || !reflect.DeepEqual(got, tc.want) {
					t.Errorf("ParseQuantConfig = %+v, %v; want %+v", got, err, tc.want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.HasPrefix(err.Error(), "fp8: ParseQuantConfig: ") || strings.Contains(err.Error(), "\n") {
				t.Errorf("ParseQuantConfig error = %v, want one line containing %q", err, tc.err)
			}
		})
	}
}

// TestParseQuantConfigFromConfigJSON is how moe's config parser calls it:
// with the raw quantization_config member of config.json.
func TestParseQuantConfigFromConfigJSON(t *testing.T) {
	cfg := `{"model_type": "deepseek_v3", "hidden_size": 7168, "quantization_config": ` + deepseekV3Quant + `}`
	var m struct {
		Quant json.RawMessage `json:"quantization_config"`
	}
	if err := json.Unmarshal([]byte(cfg), &m); err != nil {
		t.Fatal(err)
	}
	q, err := ParseQuantConfig(m.Quant)
	if err != nil || q.Block() != [2]int{128, 128} {
		t.Fatalf("ParseQuantConfig = %+v, %v", q, err)
	}
}

func TestWithQuantConfig(t *testing.T) {
	in := []byte(`{"model_type": "deepseek_v3", "hidden_size": 7168}`)
	out, err := WithQuantConfig(in, HubQuantConfig())
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatal(err)
	}
	if string(m["model_type"]) != `"deepseek_v3"` || string(m["hidden_size"]) != "7168" {
		t.Errorf("other fields lost: %s", out)
	}
	// The written member equals DeepSeek-V3's, field for field.
	var got, want map[string]any
	if err := json.Unmarshal(m["quantization_config"], &got); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(deepseekV3Quant), &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("quantization_config = %v, want DeepSeek-V3's %v", got, want)
	}
	if q, err := ParseQuantConfig(m["quantization_config"]); err != nil || !reflect.DeepEqual(q, HubQuantConfig()) {
		t.Errorf("round trip: %+v, %v", q, err)
	}
	if _, err := WithQuantConfig(out, HubQuantConfig()); err == nil || !strings.Contains(err.Error(), "already has a quantization_config") {
		t.Errorf("second WithQuantConfig: err = %v", err)
	}
	if _, err := WithQuantConfig([]byte(`[1]`), HubQuantConfig()); err == nil {
		t.Error("a list accepted as config.json")
	}
	if _, err := WithQuantConfig(in, nil); err == nil {
		t.Error("nil QuantConfig accepted")
	}
}
