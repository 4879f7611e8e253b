package fp8

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
)

// QuantConfig is config.json's quantization_config for FP8 block-scaled
// weights, as DeepSeek-V3/R1 and Qwen3-FP8 ship it:
//
//	"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
//	  "quant_method": "fp8", "weight_block_size": [128, 128]}
//
// ParseQuantConfig returns only configurations this package supports, so a
// *QuantConfig from it always has those four values.
type QuantConfig struct {
	QuantMethod      string `json:"quant_method"`
	Fmt              string `json:"fmt"`
	ActivationScheme string `json:"activation_scheme"`
	WeightBlockSize  [2]int `json:"weight_block_size"`
	// ModulesToNotConvert lists modules a checkpoint keeps unquantized
	// (transformers' FineGrainedFP8Config field); informative only: a tensor's
	// own dtype says whether it is FP8.
	ModulesToNotConvert []string `json:"modules_to_not_convert,omitempty"`
}

// HubQuantConfig returns the quantization_config of DeepSeek-V3/R1 and
// Qwen3-FP8: fp8, e4m3, dynamic activations, 128x128 weight blocks.
func HubQuantConfig() *QuantConfig {
	return &QuantConfig{QuantMethod: "fp8", Fmt: "e4m3", ActivationScheme: "dynamic", WeightBlockSize: defaultBlock}
}

// Block returns WeightBlockSize.
func (q *QuantConfig) Block() [2]int { return q.WeightBlockSize }

// rawQuantConfig is quantization_config as the file may spell it; absent
// fields stay nil.
type rawQuantConfig struct {
	QuantMethod         *string         `json:"quant_method"`
	Fmt                 *string         `json:"fmt"`
	ActivationScheme    *string         `json:"activation_scheme"`
	WeightBlockSize     json.RawMessage `json:"weight_block_size"`
	ModulesToNotConvert []string        `json:"modules_to_not_convert"`
}

// ParseQuantConfig parses the value of config.json's quantization_config
// (the raw JSON object) and checks that it describes FP8 E4M3 weights in
// 128x128 blocks with dynamic activation scales. The error is one line
// naming the field, its value and what is supported:
//   - quant_method must be "fp8" (other methods, such as "fbgemm_fp8",
//     "compressed-tensors", "gptq" or "awq", are refused);
//   - fmt must be "e4m3"; absent, it is e4m3 (the only format DeepSeek and
//     Qwen ship, and the one transformers assumes);
//   - activation_scheme must be "dynamic" (absent: dynamic, transformers'
//     default); "static" needs per-tensor activation scales this package
//     does not read;
//   - weight_block_size must be [128, 128]; absent, it is an error (vLLM
//     then reads per-tensor weight_scale tensors, which this package does
//     not).
//
// Other fields are ignored.
func ParseQuantConfig(raw json.RawMessage) (*QuantConfig, error) {
	q, err := parseQuantConfig(raw)
	if err != nil {
		return nil, fmt.Errorf("fp8: ParseQuantConfig: %w", err)
	}
	return q, nil
}

func parseQuantConfig(raw json.RawMessage) (*QuantConfig, error) {
	if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] != '{' {
		return nil, errors.New("quantization_config is not a JSON object; want {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", \"activation_scheme\": \"dynamic\", \"weight_block_size\": [128, 128]}")
	}
	var r rawQuantConfig
	if err := json.Unmarshal(raw, &r); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return nil, fmt.Errorf("quantization_config.%s is %s, not the type expected (a string, or a list of strings for modules_to_not_convert)", te.Field, te.Value)
		}
		return nil, fmt.Errorf("quantization_config is not valid JSON: %w", err)
	}
	q := HubQuantConfig()
	switch {
	case r.QuantMethod == nil:
		return nil, errors.New("quantization_config has no quant_method; want \"fp8\"")
	case *r.QuantMethod != "fp8":
		return nil, fmt.Errorf("quantization_config.quant_method = %q is not supported; want \"fp8\" (block-scaled FP8, as DeepSeek-V3 and Qwen3-FP8 ship)", *r.QuantMethod)
	case r.Fmt != nil && *r.Fmt != "e4m3":
		return nil, fmt.Errorf("quantization_config.fmt = %q is not supported; want \"e4m3\"", *r.Fmt)
	case r.ActivationScheme != nil && *r.ActivationScheme != "dynamic":
		return nil, fmt.Errorf("quantization_config.activation_scheme = %q is not supported; want \"dynamic\" (activation scales computed per token at run time)", *r.ActivationScheme)
	}
	bs, err := parseBlockSize(r.WeightBlockSize)
	if err != nil {
		return nil, err
	}
	q.WeightBlockSize = bs
	q.ModulesToNotConvert = slices.Clone(r.ModulesToNotConvert)
	return q, nil
}

// parseBlockSize parses weight_block_size, which must be [128, 128].
func parseBlockSize(raw json.RawMessage) ([2]int, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return [2]int{}, errors.New("quantization_config has no weight_block_size: per-tensor FP8 scales are not supported; want [128, 128] (block-scaled, as DeepSeek-V3 and Qwen3-FP8)")
	}
	var bs []json.Number
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&bs); err != nil {
		return [2]int{}, fmt.Errorf("quantization_config.weight_block_size = %s is not a list of two integers; want [128, 128]", raw)
	}
	if len(bs) != 2 || bs[0] != "128" || bs[1] != "128" {
		return [2]int{}, fmt.Errorf("quantization_config.weight_block_size = %s is not supported; want [128, 128] (the block of the FP8 kernels)", compact(raw))
	}
	return defaultBlock, nil
}

// compact returns raw JSON without insignificant white space (raw itself if
// it is not valid JSON).
func compact(raw json.RawMessage) string {
	var b bytes.Buffer
	if json.Compact(&b, raw) != nil {
		return string(raw)
	}
	return b.String()
}

// WithQuantConfig returns configJSON (a config.json object) with
// "quantization_config" set to q, for writing an FP8 checkpoint. The other
// fields are kept, the keys sorted and indented as moe's HFConfig writes
// them. A config that already has a quantization_config is an error.
func WithQuantConfig(configJSON []byte, q *QuantConfig) ([]byte, error) {
	if q == nil {
		return nil, errors.New("fp8: WithQuantConfig: nil *QuantConfig")
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(configJSON, &m); err != nil || m == nil {
		return nil, fmt.Errorf("fp8: WithQuantConfig: config.json is not a JSON object: %v", err)
	}
	if _, ok := m["quantization_config"]; ok {
		return nil, errors.New("fp8: WithQuantConfig: config.json already has a quantization_config")
	}
	qj, err := json.Marshal(q)
	if err != nil {
		return nil, fmt.Errorf("fp8: WithQuantConfig: %w", err)
	}
	m["quantization_config"] = qj
	return json.MarshalIndent(m, "", "  ")
}
