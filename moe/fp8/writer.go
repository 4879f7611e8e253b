package fp8

import (
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"github.com/gpuctx/gpuctx/internal/atomicfile"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// QuantizeTensors returns ts in the Hub's FP8 format, in the same order:
// each tensor that Quantizable names (it must be a 2-D F32, BF16 or F16
// tensor) becomes an F8_E4M3 weight quantized in q's blocks (Quantize),
// followed by its F32 ScaleName tensor; every other tensor is kept, in the
// dtype DeepSeek-V3's FP8 checkpoint stores it: F32 for
// e_score_correction_bias, BF16 for the rest (the router gate.weight,
// shared_expert_gate.weight, norms). A fused expert tensor
// (experts.gate_up_proj, experts.down_proj) is an error: the Hub's FP8
// checkpoints store experts one by one. Tensors are converted by up to
// GOMAXPROCS goroutines; the result does not depend on their number.
func QuantizeTensors(ts []safetensors.Tensor, q *QuantConfig) ([]safetensors.Tensor, error) {
	if q == nil {
		return nil, errors.New("fp8: QuantizeTensors: nil *QuantConfig")
	}
	out := make([][]safetensors.Tensor, len(ts))
	errs := make([]error, len(ts))
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for i := range ts {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			out[i], errs[i] = convertTensor(&ts[i], q)
		}()
	}
	wg.Wait()
	var res []safetensors.Tensor
	for i := range ts {
		if errs[i] != nil {
			return nil, fmt.Errorf("fp8: QuantizeTensors: tensor %s: %w", ts[i].Name, errs[i])
		}
		res = append(res, out[i]...)
	}
	return res, nil
}

// convertTensor returns t as the Hub's FP8 checkpoints store it: an FP8
// weight and its scales, or t in its kept dtype.
func convertTensor(t *safetensors.Tensor, q *QuantConfig) ([]safetensors.Tensor, error) {
	if strings.HasSuffix(t.Name, "experts.gate_up_proj") || strings.HasSuffix(t.Name, "experts.down_proj") {
		return nil, errors.New("the fused expert layout has no FP8 form on the Hub; write the experts one by one (experts.<e>.gate_proj.weight, ...)")
	}
	if !t.DType.IsFloat() || t.DType == safetensors.F64 {
		return nil, fmt.Errorf("dtype %s: want F32, BF16 or F16", t.DType)
	}
	n := 1
	for _, d := range t.Shape {
		if d < 0 || (d > 0 && n > len(t.Data)/d) {
			return nil, fmt.Errorf("shape %v does not match its %d data bytes", t.Shape, len(t.Data))
		}
		n *= d
	}
	vals := make([]float32, n)
	if err := safetensors.DecodeFloat32(vals, t.Data, t.DType); err != nil {
		return nil, err
	}
	if !Quantizable(t.Name) {
		dt := safetensors.BF16
		if strings.HasSuffix(t.Name, "e_score_correction_bias") {
			dt = safetensors.F32
		}
		k, err := safetensors.FromFloat32(t.Name, dt, t.Shape, vals)
		return []safetensors.Tensor{k}, err
	}
	if len(t.Shape) != 2 {
		return nil, fmt.Errorf("shape %v: a projection weight must be 2-D [out, in]", t.Shape)
	}
	w, err := quantize(vals, t.Shape[0], t.Shape[1], q.Block())
	if err != nil {
		return nil, err
	}
	ss := ScaleShape(w.Rows, w.Cols, w.Block)
	scales, err := safetensors.FromFloat32(ScaleName(t.Name), safetensors.F32, ss[:], w.Scales)
	if err != nil {
		return nil, err
	}
	return []safetensors.Tensor{{Name: t.Name, DType: safetensors.F8E4M3, Shape: []int{w.Rows, w.Cols}, Data: w.Codes}, scales}, nil
}

// WriteCheckpoint writes an FP8 checkpoint in the Hub's format into dir:
// config.json (configJSON with q as its quantization_config, see
// WithQuantConfig) and model.safetensors (QuantizeTensors(ts, q), with
// metadata meta, {"format": "pt"} when nil). Each file is written
// atomically (a temporary file renamed over the target), and an existing
// file is replaced: callers that must not overwrite check first. dir must
// exist.
func WriteCheckpoint(dir string, configJSON []byte, ts []safetensors.Tensor, q *QuantConfig, meta map[string]string) error {
	cj, err := WithQuantConfig(configJSON, q)
	if err != nil {
		return err
	}
	ft, err := QuantizeTensors(ts, q)
	if err != nil {
		return err
	}
	if meta == nil {
		meta = map[string]string{"format": "pt"}
	}
	if err := atomicfile.WriteFile(filepath.Join(dir, "config.json"), append(cj, '\n')); err != nil {
		return fmt.Errorf("fp8: WriteCheckpoint: %w", err)
	}
	if err := safetensors.Write(filepath.Join(dir, "model.safetensors"), ft, meta); err != nil {
		return fmt.Errorf("fp8: WriteCheckpoint: %w", err)
	}
	return nil
}
