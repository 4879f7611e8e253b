package fp8

import (
	"fmt"
	"math"
)

// BlockSize is the only weight_block_size the package accepts: 128 rows
// (outputs) by 128 columns (inputs), as every DeepSeek-V3/R1 and Qwen3-FP8
// checkpoint uses, and the activation group of w8a8.
const BlockSize = 128

// scaleEps bounds a block's absolute maximum from below before it becomes a
// scale, so that an all-zero block gets a positive scale (vLLM's
// per_token_group_quant_fp8 uses the same eps, 1e-10).
const scaleEps = 1e-10

// Weight is one block-scaled FP8 matrix in the nn.Linear layout of the
// checkpoint: Rows outputs by Cols inputs, row-major, where the real weight
// is w[i][j] = FromE4M3(Codes[i*Cols+j]) * Scales[(i/Block[0])*SC + j/Block[1]]
// with SC = ceil(Cols/Block[1]): the checkpoint's `...weight` (F8_E4M3) and
// `...weight_scale_inv` (its shape [ceil(Rows/Block[0]), ceil(Cols/Block[1])]).
// The last block row and column are partial when the sizes are not multiples
// of the block. A Weight is plain data, safe to read from many goroutines.
type Weight struct {
	Rows, Cols int
	// Block is weight_block_size: [rows per block, columns per block].
	Block [2]int
	// Codes holds Rows*Cols E4M3 codes.
	Codes []uint8
	// Scales holds the scale_inv of each block, row-major.
	Scales []float32
}

// ScaleShape returns the shape of the scale_inv of a rows x cols weight in
// blocks of block[0] x block[1]: [ceil(rows/block[0]), ceil(cols/block[1])].
func ScaleShape(rows, cols int, block [2]int) [2]int {
	return [2]int{ceilDiv(rows, block[0]), ceilDiv(cols, block[1])}
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

var defaultBlock = [2]int{BlockSize, BlockSize}

// checkDims checks a rows x cols matrix of n values in blocks of block.
func checkDims(rows, cols, n int, block [2]int) error {
	switch {
	case rows <= 0 || cols <= 0:
		return fmt.Errorf("shape [%d, %d] is empty or negative", rows, cols)
	case block[0] <= 0 || block[1] <= 0:
		return fmt.Errorf("block size %v is not positive", block)
	case rows > math.MaxInt32/cols:
		return fmt.Errorf("shape [%d, %d] has more than 2^31-1 elements", rows, cols)
	case n != rows*cols:
		return fmt.Errorf("%d values for shape [%d, %d], want %d", n, rows, cols, rows*cols)
	}
	return nil
}

// Quantize quantizes the rows x cols matrix w (row-major, nn.Linear layout)
// in blocks of block[0] x block[1], as DeepSeek's and vLLM's tooling does:
// each block's scale_inv is s = max(amax, 1e-10) / 448 (amax = the largest
// |w| in the block) and each value becomes E4M3(w / s), all in float32, so
// the block's largest value maps to +-448. A NaN or infinite weight is an
// error naming it.
func Quantize(w []float32, rows, cols int, block [2]int) (*Weight, error) {
	q, err := quantize(w, rows, cols, block)
	if err != nil {
		return nil, fmt.Errorf("fp8: Quantize: %w", err)
	}
	return q, nil
}

func quantize(w []float32, rows, cols int, block [2]int) (*Weight, error) {
	if err := checkDims(rows, cols, len(w), block); err != nil {
		return nil, err
	}
	ss := ScaleShape(rows, cols, block)
	q := &Weight{Rows: rows, Cols: cols, Block: block, Codes: make([]uint8, len(w)), Scales: make([]float32, ss[0]*ss[1])}
	for br := range ss[0] {
		r0, r1 := br*block[0], min((br+1)*block[0], rows)
		for bc := range ss[1] {
			c0, c1 := bc*block[1], min((bc+1)*block[1], cols)
			var amax float32
			for i := r0; i < r1; i++ {
				for _, v := range w[i*cols+c0 : i*cols+c1] {
					amax = max(amax, abs32(v))
				}
			}
			if amax > math.MaxFloat32 || amax != amax {
				i, j := firstNonFinite(w, cols, r0, r1, c0, c1)
				return nil, fmt.Errorf("weight [%d][%d] is %v: only finite weights can be quantized", i, j, w[i*cols+j])
			}
			s := max(amax, scaleEps) / MaxE4M3
			q.Scales[br*ss[1]+bc] = s
			for i := r0; i < r1; i++ {
				for j := c0; j < c1; j++ {
					q.Codes[i*cols+j] = E4M3(w[i*cols+j] / s)
				}
			}
		}
	}
	return q, nil
}

func abs32(v float32) float32 { return math.Float32frombits(math.Float32bits(v) &^ (1 << 31)) }

// firstNonFinite returns the position of the first NaN or infinity in the
// block [r0,r1) x [c0,c1) of a matrix with cols columns.
func firstNonFinite(w []float32, cols, r0, r1, c0, c1 int) (int, int) {
	for i := r0; i < r1; i++ {
		for j := c0; j < c1; j++ {
			if v := float64(w[i*cols+j]); math.IsNaN(v) || math.IsInf(v, 0) {
				return i, j
			}
		}
	}
	return r0, c0
}

// Check verifies w's shape, block, and lengths, that every scale is finite
// and positive and that no code is NaN (0x7f, 0xff). The error names the
// first bad scale or code.
func (w *Weight) Check() error {
	if w == nil {
		return fmt.Errorf("fp8: Weight.Check: nil *Weight")
	}
	if err := checkDims(w.Rows, w.Cols, len(w.Codes), w.Block); err != nil {
		return fmt.Errorf("fp8: Weight.Check: %w", err)
	}
	ss := ScaleShape(w.Rows, w.Cols, w.Block)
	if len(w.Scales) != ss[0]*ss[1] {
		return fmt.Errorf("fp8: Weight.Check: %d scales for a [%d, %d] weight in %dx%d blocks, want %v = %d", len(w.Scales), w.Rows, w.Cols, w.Block[0], w.Block[1], ss, ss[0]*ss[1])
	}
	if err := checkScales(w.Scales, ss[1]); err != nil {
		return fmt.Errorf("fp8: Weight.Check: %w", err)
	}
	for k, c := range w.Codes {
		if c&0x7f == 0x7f {
			return fmt.Errorf("fp8: Weight.Check: weight [%d][%d] is the E4M3 NaN code %#02x", k/w.Cols, k%w.Cols, c)
		}
	}
	return nil
}

// checkScales reports the first scale (of a row-major matrix with cols
// columns) that is not finite and positive.
func checkScales(s []float32, cols int) error {
	for k, v := range s {
		if !(v > 0 && v <= math.MaxFloat32) {
			return fmt.Errorf("scale_inv [%d][%d] = %v: block scales must be finite and positive", k/cols, k%cols, v)
		}
	}
	return nil
}

// scaleAt returns the scale_inv of the block holding element [i][j].
func (w *Weight) scaleAt(i, j int) float32 {
	return w.Scales[(i/w.Block[0])*ceilDiv(w.Cols, w.Block[1])+j/w.Block[1]]
}

// Dequantize returns the real weights, row-major [Rows][Cols]:
// FromE4M3(code) * scale_inv in float32, as DeepSeek's weight_dequant and
// fp8_cast_bf16 compute them (round the result to bf16 for their bf16
// output). w must pass Check; a Weight that does not is an error.
func (w *Weight) Dequantize() ([]float32, error) {
	if err := w.Check(); err != nil {
		return nil, err
	}
	out := make([]float32, len(w.Codes))
	for i := range w.Rows {
		for j := range w.Cols {
			out[i*w.Cols+j] = FromE4M3(w.Codes[i*w.Cols+j]) * w.scaleAt(i, j)
		}
	}
	return out, nil
}
