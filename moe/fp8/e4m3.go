// Package fp8 holds the FP8 block-scaled weight format that DeepSeek-V3/R1 and
// Qwen3-FP8 checkpoints ship in: OCP FP8 E4M3 (e4m3fn) values, one float32
// scale per 128x128 block of each projection weight, and the config.json
// quantization_config that announces them. It converts (E4M3, FromE4M3),
// quantizes and dequantizes weights (Quantize, Weight.Dequantize) and
// activations (QuantizeActivations), parses and validates the config
// (ParseQuantConfig) and the tensors of a checkpoint (CheckHeader,
// ReadWeight), writes checkpoints in the Hub's format (QuantizeTensors,
// WithQuantConfig, WriteCheckpoint), and runs the CPU reference GEMMs of one
// expert (GemmW8A16, GemmW8A8) that device kernels are tested against.
//
// Everything here is host code on plain slices: nothing touches a device, and
// every function is safe to call from many goroutines on distinct outputs.
package fp8

import "math"

// MaxE4M3 is the largest finite E4M3 value (0x7e: 1.75 * 2^8).
const MaxE4M3 = 448

// E4M3 codes of note.
const (
	// NaNE4M3 is the positive NaN code; 0xff is the negative one. E4M3 (the
	// "fn" variant) has no infinities.
	NaNE4M3 uint8 = 0x7f
	// MaxCodeE4M3 is the code of +448 (0xfe is -448).
	MaxCodeE4M3 uint8 = 0x7e
)

// e4m3Table holds FromE4M3 of every code.
var e4m3Table = func() (t [256]float32) {
	for c := range t {
		t[c] = decodeE4M3(uint8(c))
	}
	return t
}()

// decodeE4M3 computes the value of code c from its fields: sign, 4 exponent
// bits with bias 7, 3 mantissa bits; exponent 0 holds the subnormals m*2^-9;
// exponent 15 with mantissa 7 is NaN.
func decodeE4M3(c uint8) float32 {
	e, m := int(c>>3)&15, float64(c&7)
	var v float64
	switch {
	case e == 15 && m == 7:
		v = math.NaN()
	case e == 0:
		v = math.Ldexp(m, -9)
	default:
		v = math.Ldexp(8+m, e-10)
	}
	if c&0x80 != 0 {
		v = -v
	}
	return float32(v)
}

// FromE4M3 returns the value of E4M3 code c (exact; NaN for 0x7f and 0xff,
// -0 for 0x80).
func FromE4M3(c uint8) float32 { return e4m3Table[c] }

// E4M3 returns the E4M3 code nearest to f, ties to even, saturating: a finite
// value beyond the range, and an infinity, give +-448 (0x7e, 0xfe). NaN gives
// NaN with f's sign (0x7f or 0xff); -0 gives 0x80.
//
// This is what FP8 checkpoint tooling produces: DeepSeek's, vLLM's and
// DeepGEMM's quantizers clamp to [-448, 448] before their cast, and the GPU
// conversion (cvt.rn.satfinite.e4m3x2.f32) saturates. PyTorch's bare
// .to(torch.float8_e4m3fn) does not saturate: it gives NaN for |f| > 464 and
// for infinities; below that it agrees with E4M3 bit for bit.
func E4M3(f float32) uint8 {
	b := math.Float32bits(f)
	sign := uint8(b>>24) & 0x80
	a := b &^ 0x80000000
	switch {
	case a > 0x7f800000: // NaN
		return sign | NaNE4M3
	case a >= 0x43e00000: // >= 448, infinity included
		return sign | MaxCodeE4M3
	case a < 0x3c800000: // below 2^-6, the smallest normal: m * 2^-9
		m := math.RoundToEven(float64(math.Float32frombits(a)) * 512)
		return sign | uint8(m) // m == 8 is code 0x08, 2^-6
	}
	// Round the 23-bit mantissa to 3 bits, ties to even; a carry moves into
	// the exponent, which is what rounding up to the next binade means.
	r := a + 0x7ffff + (a>>20)&1
	e := r>>23 - 120 // float32 bias 127, E4M3 bias 7
	return sign | uint8(e<<3) | uint8(r>>20)&7
}
