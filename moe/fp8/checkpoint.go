package fp8

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// Source is where a checkpoint's tensors are read from: *safetensors.File is
// one (a single file); a sharded checkpoint is one through a wrapper that
// resolves each name to its shard (a weight and its scale may sit in
// different shards).
type Source interface {
	// Info returns the header entry of tensor name, false when it is absent.
	Info(name string) (safetensors.TensorInfo, bool)
	// Bytes returns tensor name's raw little-endian bytes.
	Bytes(name string) ([]byte, safetensors.TensorInfo, error)
}

// ScaleName returns the name of the block scales of FP8 weight name:
// "model.layers.3.mlp.experts.0.gate_proj.weight" gives
// "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv".
func ScaleName(weight string) string { return weight + "_scale_inv" }

// Quantizable reports whether the Hub's FP8 checkpoints store tensor name in
// FP8 with block scales: the weights of linear projections, that is every
// "<...>_proj.weight" (q_a_proj, kv_b_proj, o_proj, gate_proj, up_proj,
// down_proj of the routed experts, the shared experts and dense MLPs, ...),
// DeepSeek's kv_a_proj_with_mqa.weight, and Mixtral's experts.<e>.w1/w2/w3.
// The router (mlp.gate.weight), gate.e_score_correction_bias,
// shared_expert_gate.weight, norms, embeddings and lm_head stay as stored.
func Quantizable(name string) bool {
	mod, ok := strings.CutSuffix(name, ".weight")
	if !ok {
		return false
	}
	parent, last := "", mod
	if i := strings.LastIndexByte(mod, '.'); i >= 0 {
		parent, last = mod[:i], mod[i+1:]
	}
	switch {
	case strings.HasSuffix(last, "_proj"), last == "kv_a_proj_with_mqa":
		return true
	case last == "w1" || last == "w2" || last == "w3":
		return strings.Contains(parent, "experts.")
	}
	return false
}

// scaleDTypes are the dtypes a weight_scale_inv may have: F32 (DeepSeek),
// BF16 or F16 (some Qwen3 FP8 checkpoints).
var scaleDTypes = []safetensors.DType{safetensors.F32, safetensors.BF16, safetensors.F16}

// CheckHeader checks, from the headers only, that FP8 weight name is in src
// as an F8_E4M3 [rows, cols] tensor, and its scales ScaleName(name) as a F32,
// BF16 or F16 tensor of shape ScaleShape(rows, cols, q.Block()). The error is
// one line naming the tensor and what was expected; a scale shape that fits
// another block size says which.
func CheckHeader(src Source, name string, rows, cols int, q *QuantConfig) error {
	if err := checkHeader(src, name, rows, cols, q); err != nil {
		return fmt.Errorf("fp8: CheckHeader: %w", err)
	}
	return nil
}

func checkHeader(src Source, name string, rows, cols int, q *QuantConfig) error {
	if src == nil || q == nil {
		return errors.New("nil Source or *QuantConfig")
	}
	block := q.Block()
	if rows <= 0 || cols <= 0 || block[0] <= 0 || block[1] <= 0 {
		return fmt.Errorf("tensor %s: shape [%d, %d] in blocks %v: sizes must be positive", name, rows, cols, block)
	}
	w, ok := src.Info(name)
	if !ok {
		return fmt.Errorf("tensor %s (F8_E4M3 [%d, %d] expected) is missing", name, rows, cols)
	}
	if w.DType != safetensors.F8E4M3 {
		return fmt.Errorf("tensor %s has dtype %s; config.json's quantization_config (fp8, e4m3) wants F8_E4M3", name, w.DType)
	}
	if !slices.Equal(w.Shape, []int{rows, cols}) {
		return fmt.Errorf("tensor %s has shape %v, expected [%d, %d]", name, w.Shape, rows, cols)
	}
	sn, ss := ScaleName(name), ScaleShape(rows, cols, block)
	s, ok := src.Info(sn)
	if !ok {
		return fmt.Errorf("tensor %s (F32 %v, the block scales of %s) is missing: every F8_E4M3 weight needs its weight_scale_inv", sn, ss, name)
	}
	if !slices.Contains(scaleDTypes, s.DType) {
		return fmt.Errorf("tensor %s has dtype %s; block scales must be F32, BF16 or F16", sn, s.DType)
	}
	if !slices.Equal(s.Shape, ss[:]) {
		return fmt.Errorf("tensor %s has shape %v; a [%d, %d] weight in quantization_config.weight_block_size %v blocks needs %v%s",
			sn, s.Shape, rows, cols, block, ss, fittingBlock(rows, cols, s.Shape))
	}
	return nil
}

// fittingBlock returns a note naming the power-of-two block size that a
// rows x cols weight with scales of shape got would have, or "".
func fittingBlock(rows, cols int, got []int) string {
	if len(got) != 2 {
		return ""
	}
	for b0 := 1; b0 <= 1<<16; b0 *= 2 {
		for b1 := 1; b1 <= 1<<16; b1 *= 2 {
			if ss := ScaleShape(rows, cols, [2]int{b0, b1}); ss[0] == got[0] && ss[1] == got[1] {
				return fmt.Sprintf(" (the tensors fit [%d, %d] blocks: the checkpoint does not match its config.json)", b0, b1)
			}
		}
	}
	return ""
}

// ReadWeight reads FP8 weight name and its block scales from src after
// CheckHeader's checks, converts the scales to float32 and checks the values:
// every scale finite and positive, no weight the E4M3 NaN code. The error
// names the tensor and the first bad element.
func ReadWeight(src Source, name string, rows, cols int, q *QuantConfig) (*Weight, error) {
	if err := checkHeader(src, name, rows, cols, q); err != nil {
		return nil, fmt.Errorf("fp8: ReadWeight: %w", err)
	}
	codes, _, err := src.Bytes(name)
	if err != nil {
		return nil, fmt.Errorf("fp8: ReadWeight: %w", err)
	}
	sn := ScaleName(name)
	raw, sinfo, err := src.Bytes(sn)
	if err != nil {
		return nil, fmt.Errorf("fp8: ReadWeight: %w", err)
	}
	w := &Weight{Rows: rows, Cols: cols, Block: q.Block(), Codes: codes, Scales: make([]float32, sinfo.NumElements())}
	if len(codes) != rows*cols {
		return nil, fmt.Errorf("fp8: ReadWeight: tensor %s: %d bytes, expected %d", name, len(codes), rows*cols)
	}
	if err := safetensors.DecodeFloat32(w.Scales, raw, sinfo.DType); err != nil {
		return nil, fmt.Errorf("fp8: ReadWeight: tensor %s: %w", sn, err)
	}
	if err := checkScales(w.Scales, sinfo.Shape[1]); err != nil {
		return nil, fmt.Errorf("fp8: ReadWeight: tensor %s: %w", sn, err)
	}
	if k := slices.IndexFunc(codes, func(c uint8) bool { return c&0x7f == 0x7f }); k >= 0 {
		return nil, fmt.Errorf("fp8: ReadWeight: tensor %s: element [%d][%d] is the E4M3 NaN code %#02x", name, k/cols, k%cols, codes[k])
	}
	return w, nil
}
