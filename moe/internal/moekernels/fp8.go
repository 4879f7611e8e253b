package moekernels

import (
	_ "embed"
	"fmt"

	"github.com/gpuctx/gpuctx/kernels"
	"github.com/gpuctx/gpuctx/moe/fp8"
)

// FP8File names the registered source of the FP8 expert GEMM draft.
const FP8File = "moe_fp8.cu"

//go:embed moe_fp8.cu
var fp8Source string

// FP8Source returns moe_fp8.cu as it is compiled: the grid-dependency macros,
// then the file.
func FP8Source() string { return gridDeps + fp8Source }

// fp8W8A16Args are the parameters of gpuctx_moe_fp8_w8a16.
type fp8W8A16Args struct {
	X, W, Ws, Counts, Offsets, Y Ptr
	E, N, K, BF16                int32
}

func init() {
	kernels.Register(kernels.Source{File: FP8File, Text: FP8Source(), Kernels: []kernels.Kernel{
		kernels.Twin("gpuctx_moe_fp8_w8a16", moeFP8W8A16),
	}})
}

// moeFP8W8A16 is the twin of gpuctx_moe_fp8_w8a16 (moe_fp8.cu): for each
// expert's plan rows, y = x W_e^T with W_e's E4M3 codes and 128x128 block
// scales, in moe/fp8.GemmW8A16's order, every operation rounded to float32.
// Unlike fp8.GemmW8A16 it does not check the weights' values (a NaN code or
// scale gives NaN outputs, as on the device).
func moeFP8W8A16(m kernels.Memory, a *fp8W8A16Args) error {
	E, N, K := int(a.E), int(a.N), int(a.K)
	if E <= 0 || N <= 0 || K <= 0 {
		return fmt.Errorf("fp8_w8a16: dimensions E=%d N=%d K=%d: want them positive", E, N, K)
	}
	counts, offsets, rows, err := expertPlan(m, a.Counts, a.Offsets, E)
	if err != nil {
		return fmt.Errorf("fp8_w8a16: %w", err)
	}
	const B = fp8.BlockSize
	NB, KB := (N+B-1)/B, (K+B-1)/B
	x, err := actView(m, "x", a.X, int64(rows)*int64(K), a.BF16)
	if err != nil {
		return err
	}
	y, err := actView(m, "y", a.Y, int64(rows)*int64(N), a.BF16)
	if err != nil {
		return err
	}
	w, err := kernels.Slice[uint8](m, "w", a.W, int64(E)*int64(N)*int64(K))
	if err != nil {
		return err
	}
	ws, err := kernels.Slice[float32](m, "ws", a.Ws, int64(E)*int64(NB)*int64(KB))
	if err != nil {
		return err
	}
	xr := make([]float32, K)
	for e := range E {
		for r := int(offsets[e]); r < int(offsets[e]+counts[e]); r++ {
			for k := range xr {
				xr[k] = x.load(r*K + k)
			}
			for n := range N {
				codes := w[(e*N+n)*K : (e*N+n+1)*K]
				scales := ws[(e*NB+n/B)*KB : (e*NB+n/B+1)*KB]
				y.store(r*N+n, fp8RowDot(xr, codes, scales))
			}
		}
	}
	return nil
}

// fp8RowDot is one output of the w8a16 GEMM: block sums of x[k] times the
// decoded codes, in ascending k, each scaled and added in ascending block
// order, every operation rounded to float32 (moe/fp8.GemmW8A16's order).
func fp8RowDot(x []float32, codes []uint8, scales []float32) float32 {
	const B = fp8.BlockSize
	var acc float32
	for b, s := range scales {
		var p float32
		for k := b * B; k < min((b+1)*B, len(x)); k++ {
			p += float32(x[k] * fp8.FromE4M3(codes[k]))
		}
		acc += float32(p * s)
	}
	return acc
}
