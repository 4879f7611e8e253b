package fp8

import "fmt"

// GemmW8A16 is the CPU reference of the weight-only FP8 GEMM of one expert
// projection: y = x W^T, that is y[t][n] = sum_k x[t][k] * w[n][k] for
// tokens rows of x ([tokens][w.Cols], bf16 activations widened to float32,
// or float32 ones) into y ([tokens][w.Rows], float32), with w's codes
// dequantized on the fly and its block scale applied once per block of K.
//
// The accumulation order, which a device kernel that wants to match it bit
// for bit reproduces (a tensor-core kernel sums each block in its own order
// and matches it within rounding), is, for each y[t][n], every operation
// rounded to float32:
//
//	acc = 0
//	for each K block kb = 0, 1, ... (w.Block[1] columns, the last partial):
//	    p = 0
//	    for k in the block, ascending: p = p + x[t][k] * FromE4M3(code[n][k])
//	    acc = acc + p * scale_inv[n / w.Block[0]][kb]
//	y[t][n] = acc
//
// The products are exact when x holds bf16 values (8 + 4 significant bits),
// so a fused multiply-add gives the same p. Each product and sum is rounded
// separately (no fusion). w must pass Check; shapes that do not match are an
// error.
func GemmW8A16(y, x []float32, tokens int, w *Weight) error {
	if err := w.Check(); err != nil {
		return fmt.Errorf("fp8: GemmW8A16: %w", err)
	}
	if err := checkGemm(len(y), len(x), tokens, w); err != nil {
		return fmt.Errorf("fp8: GemmW8A16: %w", err)
	}
	K, B0, B1 := w.Cols, w.Block[0], w.Block[1]
	kb := ceilDiv(K, B1)
	for t := range tokens {
		xr := x[t*K : (t+1)*K]
		for n := range w.Rows {
			codes, scales := w.Codes[n*K:(n+1)*K], w.Scales[(n/B0)*kb:(n/B0+1)*kb]
			var acc float32
			for b, s := range scales {
				var p float32
				for k := b * B1; k < min((b+1)*B1, K); k++ {
					p += float32(xr[k] * e4m3Table[codes[k]])
				}
				acc += float32(p * s)
			}
			y[t*w.Rows+n] = acc
		}
	}
	return nil
}

// GemmW8A8 is the CPU reference of the FP8 x FP8 GEMM of one expert
// projection: y = x W^T with x quantized per token per group
// (QuantizeActivations with group w.Block[1]), y[t][n] float32 for
// [x.Tokens][w.Rows].
//
// The accumulation order, as vLLM's block-FP8 Triton kernel and a
// tensor-core kernel compute it (one MMA chain per block of K, in float32,
// then both scales), for each y[t][n], every operation rounded to float32:
//
//	acc = 0
//	for each K block kb:
//	    p = 0
//	    for k in the block, ascending: p = p + FromE4M3(xq[t][k]) * FromE4M3(code[n][k])
//	    acc = acc + (p * xscale[t][kb]) * scale_inv[n / w.Block[0]][kb]
//	y[t][n] = acc
//
// The products of two E4M3 values are exact in float32. x's group must be
// w's column block and x.Cols must be w.Cols; both must pass their checks.
func GemmW8A8(y []float32, x *Activations, w *Weight) error {
	if err := w.Check(); err != nil {
		return fmt.Errorf("fp8: GemmW8A8: %w", err)
	}
	if err := x.check(); err != nil {
		return fmt.Errorf("fp8: GemmW8A8: activations: %w", err)
	}
	if x.Group != w.Block[1] {
		return fmt.Errorf("fp8: GemmW8A8: activation groups of %d columns, but the weight's blocks are %d columns wide; quantize x with group %d", x.Group, w.Block[1], w.Block[1])
	}
	if err := checkGemm(len(y), len(x.Codes), x.Tokens, w); err != nil {
		return fmt.Errorf("fp8: GemmW8A8: %w", err)
	}
	K, B0, B1 := w.Cols, w.Block[0], w.Block[1]
	kb := ceilDiv(K, B1)
	for t := range x.Tokens {
		xr, xs := x.Codes[t*K:(t+1)*K], x.Scales[t*kb:(t+1)*kb]
		for n := range w.Rows {
			codes, scales := w.Codes[n*K:(n+1)*K], w.Scales[(n/B0)*kb:(n/B0+1)*kb]
			var acc float32
			for b, s := range scales {
				var p float32
				for k := b * B1; k < min((b+1)*B1, K); k++ {
					p += float32(e4m3Table[xr[k]] * e4m3Table[codes[k]])
				}
				acc += float32(float32(p*xs[b]) * s)
			}
			y[t*w.Rows+n] = acc
		}
	}
	return nil
}

// checkGemm checks the lengths of y and x for tokens rows against w.
func checkGemm(ny, nx, tokens int, w *Weight) error {
	switch {
	case tokens <= 0:
		return fmt.Errorf("%d tokens: want at least one", tokens)
	case nx != tokens*w.Cols:
		return fmt.Errorf("x has %d values, want [%d tokens][%d] = %d", nx, tokens, w.Cols, tokens*w.Cols)
	case ny != tokens*w.Rows:
		return fmt.Errorf("y has %d values, want [%d tokens][%d] = %d", ny, tokens, w.Rows, tokens*w.Rows)
	}
	return nil
}
