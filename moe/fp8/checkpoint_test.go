package fp8

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// memSource is a Source over an encoded safetensors file held in memory.
type memSource struct {
	h    *safetensors.Header
	data []byte
}

func newMemSource(t *testing.T, ts []safetensors.Tensor) *memSource {
	t.Helper()
	data, err := safetensors.Encode(ts, nil)
	if err != nil {
		t.Fatal(err)
	}
	h, err := safetensors.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	return &memSource{h, data}
}

func (m *memSource) Info(name string) (safetensors.TensorInfo, bool) {
	ti, ok := m.h.Tensors[name]
	return ti, ok
}

func (m *memSource) Bytes(name string) ([]byte, safetensors.TensorInfo, error) {
	ti, ok := m.h.Tensors[name]
	if !ok {
		return nil, ti, fmt.Errorf("tensor %s not found", name)
	}
	return slices.Clone(m.data[m.h.DataOffset+ti.Begin : m.h.DataOffset+ti.End]), ti, nil
}

func TestQuantizable(t *testing.T) {
	for name, want := range map[string]bool{
		"model.layers.3.mlp.experts.0.gate_proj.weight":             true,
		"model.layers.3.mlp.experts.255.down_proj.weight":           true,
		"model.layers.3.mlp.shared_experts.up_proj.weight":          true,
		"model.layers.1.mlp.shared_expert.up_proj.weight":           true,
		"model.layers.0.mlp.gate_proj.weight":                       true, // a dense layer's MLP
		"model.layers.0.self_attn.kv_a_proj_with_mqa.weight":        true,
		"model.layers.0.self_attn.q_b_proj.weight":                  true,
		"model.layers.0.self_attn.o_proj.weight":                    true,
		"model.layers.1.block_sparse_moe.experts.7.w2.weight":       true,
		"model.layers.3.mlp.gate.weight":                            false, // the router
		"model.layers.3.mlp.gate.e_score_correction_bias":           false,
		"model.layers.1.mlp.shared_expert_gate.weight":              false,
		"model.layers.1.block_sparse_moe.gate.weight":               false,
		"model.layers.0.input_layernorm.weight":                     false,
		"model.layers.0.self_attn.kv_a_layernorm.weight":            false,
		"model.embed_tokens.weight":                                 false,
		"lm_head.weight":                                            false,
		"model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv":   false,
		"model.layers.3.mlp.experts.gate_up_proj":                   false,
		"model.layers.0.mlp.w1.weight":                              false, // not an expert
		"model.layers.0.self_attn.q_proj.bias":                      false,
		"model.layers.3.mlp.experts.0.gate_proj.weight.extra":       false,
		"model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv.x": false,
	} {
		if got := Quantizable(name); got != want {
			t.Errorf("Quantizable(%q) = %v, want %v", name, got, want)
		}
	}
}

// dsv3Layer returns f32 tensors of a small DeepSeek-V3-style MoE layer 3 with
// the Hub's names: E experts of width I, one shared expert, the router and
// the correction bias. H and I are not multiples of 128 (partial blocks).
func dsv3Layer(H, I, E int) []safetensors.Tensor {
	var ts []safetensors.Tensor
	add := func(name string, shape ...int) {
		n := 1
		for _, d := range shape {
			n *= d
		}
		r := rand.New(rand.NewPCG(uint64(len(ts)), 1))
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(r.NormFloat64() * 0.05)
		}
		t, err := safetensors.FromFloat32(name, safetensors.F32, shape, v)
		if err != nil {
			panic(err)
		}
		ts = append(ts, t)
	}
	p := "model.layers.3.mlp."
	add(p+"gate.weight", E, H)
	add(p+"gate.e_score_correction_bias", E)
	for e := range E {
		add(fmt.Sprintf("%sexperts.%d.gate_proj.weight", p, e), I, H)
		add(fmt.Sprintf("%sexperts.%d.up_proj.weight", p, e), I, H)
		add(fmt.Sprintf("%sexperts.%d.down_proj.weight", p, e), H, I)
	}
	add(p+"shared_experts.gate_proj.weight", I, H)
	add(p+"shared_experts.up_proj.weight", I, H)
	add(p+"shared_experts.down_proj.weight", H, I)
	return ts
}

// TestQuantizeTensorsHubFormat checks the written layer against the Hub's
// format: projection weights F8_E4M3 [out, in] each followed by its F32
// weight_scale_inv [ceil(out/128), ceil(in/128)]; the router BF16 and the
// correction bias F32 as DeepSeek-V3 stores them; and that ReadWeight reads
// back exactly what Quantize produced.
func TestQuantizeTensorsHubFormat(t *testing.T) {
	const H, I, E = 200, 136, 3
	in := dsv3Layer(H, I, E)
	out, err := QuantizeTensors(in, HubQuantConfig())
	if err != nil {
		t.Fatal(err)
	}
	if want := len(in) + 3*E + 3; len(out) != want {
		t.Fatalf("%d tensors written, want %d", len(out), want)
	}
	src := newMemSource(t, out)
	p := "model.layers.3.mlp."
	if ti, _ := src.Info(p + "gate.weight"); ti.DType != safetensors.BF16 || !slices.Equal(ti.Shape, []int{E, H}) {
		t.Errorf("router: %s %v, want BF16 [%d %d]", ti.DType, ti.Shape, E, H)
	}
	if ti, _ := src.Info(p + "gate.e_score_correction_bias"); ti.DType != safetensors.F32 {
		t.Errorf("correction bias: %s, want F32", ti.DType)
	}
	for _, tn := range in {
		if !Quantizable(tn.Name) {
			continue
		}
		rows, cols := tn.Shape[0], tn.Shape[1]
		wi, _ := src.Info(tn.Name)
		si, _ := src.Info(ScaleName(tn.Name))
		ss := ScaleShape(rows, cols, defaultBlock)
		if wi.DType != safetensors.F8E4M3 || si.DType != safetensors.F32 || !slices.Equal(si.Shape, ss[:]) {
			t.Fatalf("%s: %s %v with scales %s %v; want F8_E4M3 and F32 %v", tn.Name, wi.DType, wi.Shape, si.DType, si.Shape, ss)
		}
		got, err := ReadWeight(src, tn.Name, rows, cols, HubQuantConfig())
		if err != nil {
			t.Fatal(err)
		}
		vals := make([]float32, rows*cols)
		if err := safetensors.DecodeFloat32(vals, tn.Data, tn.DType); err != nil {
			t.Fatal(err)
		}
		want, err := Quantize(vals, rows, cols, defaultBlock)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got.Codes, want.Codes) || !slices.Equal(got.Scales, want.Scales) {
			t.Errorf("%s: read back codes/scales differ from Quantize's", tn.Name)
		}
	}
}

func TestQuantizeTensorsErrors(t *testing.T) {
	fused, _ := safetensors.FromFloat32("model.layers.3.mlp.experts.gate_up_proj", safetensors.F32, []int{2, 4, 3}, make([]float32, 24))
	threeD, _ := safetensors.FromFloat32("model.layers.3.mlp.experts.0.up_proj.weight", safetensors.F32, []int{2, 2, 2}, make([]float32, 8))
	nan, _ := safetensors.FromFloat32("model.layers.3.mlp.experts.0.up_proj.weight", safetensors.F32, []int{2, 2}, []float32{0, 1, float32(math.NaN()), 2})
	ints, _ := safetensors.FromInt32("model.layers.3.mlp.experts.0.up_proj.weight", []int{2}, []int32{1, 2})
	short := safetensors.Tensor{Name: "x.up_proj.weight", DType: safetensors.F32, Shape: []int{4, 4}, Data: make([]byte, 8)}
	for _, tc := range []struct {
		name string
		t    safetensors.Tensor
		want string
	}{
		{"fused", fused, "fused expert layout has no FP8 form"},
		{"3-D projection", threeD, "a projection weight must be 2-D"},
		{"NaN weight", nan, "weight [1][0] is NaN"},
		{"int tensor", ints, "dtype I32"},
		{"short data", short, "does not match its 8 data bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := QuantizeTensors([]safetensors.Tensor{tc.t}, HubQuantConfig())
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "fp8: QuantizeTensors: tensor ") {
				t.Errorf("err = %v, want %q", err, tc.want)
			}
		})
	}
	if _, err := QuantizeTensors(nil, nil); err == nil {
		t.Error("nil QuantConfig accepted")
	}
}

// The loader-side bad-input cases use one routed expert weight of a
// DeepSeek-V3-style checkpoint, with partial blocks (scales [2, 3]).
const (
	badName             = "model.layers.3.mlp.experts.5.gate_proj.weight"
	badRows, badCols    = 136, 300
	badScaleRows, badSC = 2, 3
)

// goodExpert returns a valid FP8 weight and its F32 scales.
func goodExpert(t *testing.T) (w, s safetensors.Tensor) {
	t.Helper()
	q, err := Quantize(randMatrix(badRows, badCols, 9), badRows, badCols, defaultBlock)
	if err != nil {
		t.Fatal(err)
	}
	return safetensors.Tensor{Name: badName, DType: safetensors.F8E4M3, Shape: []int{badRows, badCols}, Data: q.Codes},
		scaleTensor(t, safetensors.F32, []int{badScaleRows, badSC}, q.Scales...)
}

func scaleTensor(t *testing.T, dt safetensors.DType, shape []int, v ...float32) safetensors.Tensor {
	t.Helper()
	s, err := safetensors.FromFloat32(ScaleName(badName), dt, shape, v)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

type badInputCase struct {
	name    string
	tensors func(t *testing.T) []safetensors.Tensor
	want    string // "" for valid input
}

// runBadInput checks each case with CheckHeader and ReadWeight: a valid
// case passes both; a header case (header true) fails both, a value case
// only ReadWeight; the errors are one line containing want.
func runBadInput(t *testing.T, header bool, cases []badInputCase) {
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			src := newMemSource(t, tc.tensors(t))
			herr := CheckHeader(src, badName, badRows, badCols, HubQuantConfig())
			_, rerr := ReadWeight(src, badName, badRows, badCols, HubQuantConfig())
			if tc.want == "" {
				if herr != nil || rerr != nil {
					t.Fatalf("valid input: CheckHeader: %v; ReadWeight: %v", herr, rerr)
				}
				return
			}
			if header != (herr != nil) || (herr != nil && !strings.Contains(herr.Error(), tc.want)) {
				t.Errorf("CheckHeader = %v; want an error: %v, containing %q", herr, header, tc.want)
			}
			if rerr == nil || !strings.Contains(rerr.Error(), tc.want) || strings.Contains(rerr.Error(), "\n") {
				t.Errorf("ReadWeight error = %v, want one line containing %q", rerr, tc.want)
			}
		})
	}
}

// TestCheckHeaderBadInput covers the bad inputs the headers show, on Hub
// names: a missing weight or scale tensor, a weight not F8_E4M3 or of the
// wrong shape, scales of the wrong dtype or shape (with the block size they
// fit named).
func TestCheckHeaderBadInput(t *testing.T) {
	ones := func(n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = 1
		}
		return v
	}
	runBadInput(t, true, []badInputCase{
		{"valid", func(t *testing.T) []safetensors.Tensor { w, s := goodExpert(t); return []safetensors.Tensor{w, s} }, ""},
		{"valid BF16 scales", func(t *testing.T) []safetensors.Tensor {
			w, _ := goodExpert(t)
			return []safetensors.Tensor{w, scaleTensor(t, safetensors.BF16, []int{2, 3}, ones(6)...)}
		}, ""},
		{"weight missing", func(t *testing.T) []safetensors.Tensor { _, s := goodExpert(t); return []safetensors.Tensor{s} },
			"tensor " + badName + " (F8_E4M3 [136, 300] expected) is missing"},
		{"scale missing", func(t *testing.T) []safetensors.Tensor { w, _ := goodExpert(t); return []safetensors.Tensor{w} },
			"tensor " + badName + "_scale_inv (F32 [2 3], the block scales of " + badName + ") is missing"},
		{"weight BF16", func(t *testing.T) []safetensors.Tensor {
			_, s := goodExpert(t)
			w, _ := safetensors.FromFloat32(badName, safetensors.BF16, []int{badRows, badCols}, make([]float32, badRows*badCols))
			return []safetensors.Tensor{w, s}
		}, "has dtype BF16; config.json's quantization_config (fp8, e4m3) wants F8_E4M3"},
		{"weight E5M2", func(t *testing.T) []safetensors.Tensor {
			w, s := goodExpert(t)
			w.DType = safetensors.F8E5M2
			return []safetensors.Tensor{w, s}
		}, "has dtype F8_E5M2"},
		{"weight shape", func(t *testing.T) []safetensors.Tensor {
			w, s := goodExpert(t)
			w.Shape = []int{badCols, badRows}
			return []safetensors.Tensor{w, s}
		}, "has shape [300 136], expected [136, 300]"},
		{"scale shape", func(t *testing.T) []safetensors.Tensor {
			w, _ := goodExpert(t)
			return []safetensors.Tensor{w, scaleTensor(t, safetensors.F32, []int{3, 2}, ones(6)...)}
		}, "has shape [3 2]; a [136, 300] weight in quantization_config.weight_block_size [128 128] blocks needs [2 3]"},
		{"scales of 64x64 blocks", func(t *testing.T) []safetensors.Tensor {
			w, _ := goodExpert(t)
			return []safetensors.Tensor{w, scaleTensor(t, safetensors.F32, []int{3, 5}, ones(15)...)}
		}, "(the tensors fit [64, 64] blocks: the checkpoint does not match its config.json)"},
		{"scale dtype", func(t *testing.T) []safetensors.Tensor {
			w, _ := goodExpert(t)
			s, _ := safetensors.FromInt32(ScaleName(badName), []int{2, 3}, make([]int32, 6))
			return []safetensors.Tensor{w, s}
		}, "has dtype I32; block scales must be F32, BF16 or F16"},
	})
}

// TestReadWeightBadValues covers the bad inputs only the values show: NaN,
// infinite, zero or negative scales, and a weight holding the E4M3 NaN code.
func TestReadWeightBadValues(t *testing.T) {
	withScales := func(v ...float32) func(t *testing.T) []safetensors.Tensor {
		return func(t *testing.T) []safetensors.Tensor {
			w, _ := goodExpert(t)
			return []safetensors.Tensor{w, scaleTensor(t, safetensors.F32, []int{2, 3}, v...)}
		}
	}
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	runBadInput(t, false, []badInputCase{
		{"NaN scale", withScales(1, 1, 1, 1, nan, 1), "tensor " + badName + "_scale_inv: scale_inv [1][1] = NaN: block scales must be finite and positive"},
		{"Inf scale", withScales(1, 1, inf, 1, 1, 1), "scale_inv [0][2] = +Inf"},
		{"zero scale", withScales(1, 0, 1, 1, 1, 1), "scale_inv [0][1] = 0"},
		{"negative scale", withScales(1, 1, 1, 1, 1, -2), "scale_inv [1][2] = -2"},
		{"NaN weight code", func(t *testing.T) []safetensors.Tensor {
			w, s := goodExpert(t)
			w.Data[7*badCols+11] = 0xff
			return []safetensors.Tensor{w, s}
		}, "tensor " + badName + ": element [7][11] is the E4M3 NaN code 0xff"},
	})
}

// TestWriteCheckpoint writes a layer to disk and reads it back as moe's
// loader will: config.json's quantization_config through ParseQuantConfig,
// the tensors through safetensors.Open and ReadWeight.
func TestWriteCheckpoint(t *testing.T) {
	dir := t.TempDir()
	cfg := []byte(`{"model_type": "deepseek_v3", "hidden_size": 200, "moe_intermediate_size": 136, "n_routed_experts": 3}`)
	in := dsv3Layer(200, 136, 3)
	if err := WriteCheckpoint(dir, cfg, in, HubQuantConfig(), nil); err != nil {
		t.Fatal(err)
	}
	cj, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		ModelType string          `json:"model_type"`
		Quant     json.RawMessage `json:"quantization_config"`
	}
	if err := json.Unmarshal(cj, &m); err != nil {
		t.Fatal(err)
	}
	if q, err := ParseQuantConfig(m.Quant); err != nil || m.ModelType != "deepseek_v3" || q.Block() != defaultBlock {
		t.Fatalf("config.json: model_type %q, quantization_config %s: %v", m.ModelType, m.Quant, err)
	}
	f, err := safetensors.Open(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Header.Metadata["format"] != "pt" {
		t.Errorf("metadata %v, want format pt", f.Header.Metadata)
	}
	name := "model.layers.3.mlp.experts.2.down_proj.weight"
	w, err := ReadWeight(f, name, 200, 136, HubQuantConfig())
	if err != nil {
		t.Fatal(err)
	}
	deq, err := w.Dequantize()
	if err != nil {
		t.Fatal(err)
	}
	orig := make([]float32, 200*136)
	for _, tn := range in {
		if tn.Name == name {
			_ = safetensors.DecodeFloat32(orig, tn.Data, tn.DType)
		}
	}
	for k := range orig {
		bound := (math.Abs(float64(orig[k]))/16 + float64(w.scaleAt(k/136, k%136))/1024) * (1 + 1e-6)
		if d := math.Abs(float64(deq[k] - orig[k])); d > bound {
			t.Fatalf("element %d: %v read back as %v", k, orig[k], deq[k])
		}
	}
	if err := WriteCheckpoint(filepath.Join(dir, "missing"), cfg, in, HubQuantConfig(), nil); err == nil {
		t.Error("writing into a missing directory succeeded")
	}
}
