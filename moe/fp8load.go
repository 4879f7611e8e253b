package moe

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/moe/fp8"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// Reading FP8 checkpoints (config.json's quantization_config, Config.Quant):
// a projection weight stored as F8_E4M3 comes with its block scales
// (fp8.ScaleName). resolveLayer checks both headers (fp8.CheckHeader) and
// reads and checks the scales, which are small, before anything is
// allocated; the codes are read with the rest, and are either dequantized
// (f32 and bf16 layers, LoadWeights) or uploaded as they are (the routed
// experts of an FP8 layer, stage_experts_fp8.go).

// ckSource is a checkpoint seen as an fp8.Source: a weight and its scales may
// sit in different shards.
type ckSource struct{ ck *checkpoint }

func (s ckSource) Info(name string) (safetensors.TensorInfo, bool) {
	f, ok, err := s.ck.file(name)
	if err != nil || !ok {
		return safetensors.TensorInfo{}, false
	}
	return f.Info(name)
}

func (s ckSource) Bytes(name string) ([]byte, safetensors.TensorInfo, error) {
	f, ok, err := s.ck.file(name)
	if err != nil {
		return nil, safetensors.TensorInfo{}, err
	}
	if !ok {
		return nil, safetensors.TensorInfo{}, fmt.Errorf("tensor %s is missing from %s", name, s.ck.describe)
	}
	return f.Bytes(name)
}

// fp8Scales checks FP8 weight name (shape as the layer wants it) and its
// block scales against the headers and q, then reads the scales and checks
// that each is finite and positive. The error is one line naming the tensor.
func (c *checkpoint) fp8Scales(name string, shape []int, q *fp8.QuantConfig) ([]float32, error) {
	if q == nil {
		return nil, fmt.Errorf("tensor %s is F8_E4M3, but config.json has no quantization_config; an FP8 checkpoint's config says {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", \"weight_block_size\": [128, 128], ...}", name)
	}
	if len(shape) != 2 {
		return nil, fmt.Errorf("tensor %s is F8_E4M3 with shape %v: FP8 experts are read one by one ([out, in] with block scales), not in the fused layout", name, shape)
	}
	if err := fp8.CheckHeader(ckSource{c}, name, shape[0], shape[1], q); err != nil {
		return nil, err
	}
	sn := fp8.ScaleName(name)
	f, _, err := c.file(sn)
	if err != nil {
		return nil, err
	}
	s, info, err := f.Float32(sn)
	if err != nil {
		return nil, err
	}
	for k, v := range s {
		if !(v > 0 && v <= math.MaxFloat32) {
			return nil, fmt.Errorf("tensor %s: scale_inv [%d][%d] = %v: block scales must be finite and positive (in %s)", sn, k/info.Shape[1], k%info.Shape[1], v, f.Path)
		}
	}
	return s, nil
}

// fp8Weight returns rows [row0, row0+rows) of FP8 tensor t (cols columns,
// scales t.scales in block's blocks) as an fp8.Weight: the codes read from
// the file and the scales of those rows. row0 must be a multiple of block[0].
// A NaN code is an error naming the tensor and the element.
func (t *checkedTensor) fp8Weight(name string, row0, rows, cols int) (*fp8.Weight, error) {
	sc := (cols + t.block[1] - 1) / t.block[1]
	b0, b1 := row0/t.block[0], (row0+rows+t.block[0]-1)/t.block[0]
	w := &fp8.Weight{Rows: rows, Cols: cols, Block: t.block, Codes: make([]uint8, rows*cols), Scales: t.scales[b0*sc : b1*sc]}
	if err := t.f.ReadRaw(name, w.Codes, int64(row0)*int64(cols)); err != nil {
		return nil, err
	}
	if err := w.Check(); err != nil {
		return nil, fmt.Errorf("tensor %s (in %s): %w", name, t.f.Path, err)
	}
	return w, nil
}

// dequantRows writes rows [r0, r1) (tensor rows, of cols columns), columns
// [c0, c1) of FP8 tensor t, whose codes of those rows are raw, to dst in
// dtype ddt (F32, or BF16 rounded to nearest even): code * scale_inv in
// float32, as fp8.Weight.Dequantize computes it. A NaN code is an error.
func (t *checkedTensor) dequantRows(dst, raw []byte, ddt safetensors.DType, r0, r1, cols, c0, c1 int) error {
	sc := (cols + t.block[1] - 1) / t.block[1]
	w := c1 - c0
	f32 := unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(dst))), len(dst)/4)
	h := unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(dst))), len(dst)/2)
	for r := r0; r < r1; r++ {
		codes := raw[(r-r0)*cols : (r-r0+1)*cols]
		srow := t.scales[(r/t.block[0])*sc:][:sc]
		for j := c0; j < c1; j++ {
			c := codes[j]
			if c&0x7f == fp8.NaNE4M3 {
				return fmt.Errorf("element [%d][%d] is the E4M3 NaN code %#02x", r, j, c)
			}
			v := fp8.FromE4M3(c) * srow[j/t.block[1]]
			k := (r-r0)*w + j - c0
			if ddt == safetensors.F32 {
				f32[k] = v
			} else {
				h[k] = half.BF16(v)
			}
		}
	}
	return nil
}

// fp8Weight of fileWeights returns part p (of routed expert e), rows x cols:
// the checkpoint's codes and scales when it stores the part in FP8, else its
// values quantized in 128x128 blocks (fp8.Quantize), read from the file
// without a float32 copy of anything but this part.
func (s *fileWeights) fp8Weight(p weightPart, e, rows, cols int) (*fp8.Weight, error) {
	t, name, row0 := s.source(p, e)
	if t.scales != nil {
		return t.fp8Weight(name, row0, rows, cols)
	}
	ses := t.info.DType.Size()
	raw := make([]byte, rows*cols*ses)
	if err := t.f.ReadRaw(name, raw, int64(row0)*int64(cols)*int64(ses)); err != nil {
		return nil, err
	}
	v := make([]float32, rows*cols)
	if err := safetensors.DecodeFloat32(v, raw, t.info.DType); err != nil {
		return nil, fmt.Errorf("tensor %s (in %s): %w", name, t.f.Path, err)
	}
	w, err := fp8.Quantize(v, rows, cols, [2]int{fp8.BlockSize, fp8.BlockSize})
	if err != nil {
		return nil, fmt.Errorf("tensor %s (in %s): %w", name, t.f.Path, err)
	}
	return w, nil
}
