package fp8

import (
	"fmt"
	"math"
)

// Activations are tokens quantized for w8a8: each token's row of Cols values
// is cut into groups of Group columns (the last one partial when Group does
// not divide Cols), and each group has its own scale, as vLLM's
// per_token_group_quant_fp8 and DeepSeek's act_quant compute at run time.
// The value of x[t][k] is FromE4M3(Codes[t*Cols+k]) * Scales[t*G + k/Group]
// with G = ceil(Cols/Group).
type Activations struct {
	Tokens, Cols, Group int
	// Codes holds Tokens*Cols E4M3 codes, row-major.
	Codes []uint8
	// Scales holds Tokens*G scales, row-major.
	Scales []float32
}

// QuantizeActivations quantizes x, tokens rows of cols values, per token per
// group of group columns, with vLLM's per_token_group_quant_fp8 rule in
// float32: s = max(amax, 1e-10) / 448 over the group, each value
// E4M3(x / s) (clamped to +-448, which E4M3 does). A NaN or infinite input
// is an error naming it (on a device it would spread NaN through the token's
// outputs).
func QuantizeActivations(x []float32, tokens, cols, group int) (*Activations, error) {
	if err := checkDims(tokens, cols, len(x), [2]int{1, group}); err != nil {
		return nil, fmt.Errorf("fp8: QuantizeActivations: %w", err)
	}
	g := ceilDiv(cols, group)
	a := &Activations{Tokens: tokens, Cols: cols, Group: group, Codes: make([]uint8, len(x)), Scales: make([]float32, tokens*g)}
	for t := range tokens {
		row := x[t*cols : (t+1)*cols]
		for gi := range g {
			k0, k1 := gi*group, min((gi+1)*group, cols)
			var amax float32
			for _, v := range row[k0:k1] {
				amax = max(amax, abs32(v))
			}
			if amax > math.MaxFloat32 || amax != amax {
				_, k := firstNonFinite(row, cols, 0, 1, k0, k1)
				return nil, fmt.Errorf("fp8: QuantizeActivations: x[%d][%d] is %v: only finite activations can be quantized", t, k, row[k])
			}
			s := max(amax, scaleEps) / MaxE4M3
			a.Scales[t*g+gi] = s
			for k := k0; k < k1; k++ {
				a.Codes[t*cols+k] = E4M3(row[k] / s)
			}
		}
	}
	return a, nil
}

// Dequantize returns the activations' values, [Tokens][Cols] row-major:
// FromE4M3(code) * scale in float32.
func (a *Activations) Dequantize() ([]float32, error) {
	if err := a.check(); err != nil {
		return nil, fmt.Errorf("fp8: Activations.Dequantize: %w", err)
	}
	g := ceilDiv(a.Cols, a.Group)
	out := make([]float32, len(a.Codes))
	for t := range a.Tokens {
		for k := range a.Cols {
			out[t*a.Cols+k] = FromE4M3(a.Codes[t*a.Cols+k]) * a.Scales[t*g+k/a.Group]
		}
	}
	return out, nil
}

// check verifies the shape and lengths and that every scale is finite and
// positive.
func (a *Activations) check() error {
	if a == nil {
		return fmt.Errorf("nil *Activations")
	}
	if err := checkDims(a.Tokens, a.Cols, len(a.Codes), [2]int{1, a.Group}); err != nil {
		return err
	}
	g := ceilDiv(a.Cols, a.Group)
	if len(a.Scales) != a.Tokens*g {
		return fmt.Errorf("%d scales for %d tokens of %d groups, want %d", len(a.Scales), a.Tokens, g, a.Tokens*g)
	}
	return checkScales(a.Scales, g)
}
