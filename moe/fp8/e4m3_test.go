package fp8

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestFromE4M3AllCodes checks the value of every one of the 256 codes against
// the format's definition, written independently of decodeE4M3: the positive
// codes are 0, the subnormals k/512 (k = 1..7), then for each exponent
// 1..15 the eight values (8+m) * 2^(e-10), the last one (0x7f) NaN; the
// negative codes mirror them.
func TestFromE4M3AllCodes(t *testing.T) {
	var want [128]float64
	for k := 1; k < 8; k++ {
		want[k] = float64(k) / 512
	}
	v, step := 1.0/64, 1.0/512 // 2^-6, spacing 2^-9 in the first binade
	for c := 8; c < 128; c++ {
		if c > 8 && c%8 == 0 {
			step *= 2
		}
		want[c] = v
		v += step
	}
	for c := range 256 {
		got := FromE4M3(uint8(c))
		if c&0x7f == 0x7f {
			if !math.IsNaN(float64(got)) {
				t.Errorf("FromE4M3(%#02x) = %v, want NaN", c, got)
			}
			continue
		}
		w := want[c&0x7f]
		if c&0x80 != 0 {
			w = -w
		}
		if float64(got) != w || math.Signbit(float64(got)) != (c&0x80 != 0) {
			t.Errorf("FromE4M3(%#02x) = %v, want %v", c, got, w)
		}
	}
	for _, tc := range []struct {
		code uint8
		want float32
	}{{0x01, 1.0 / 512}, {0x07, 7.0 / 512}, {0x08, 1.0 / 64}, {0x38, 1}, {0x40, 2}, {0x7e, 448}, {0xfe, -448}, {0xb8, -1}} {
		if got := FromE4M3(tc.code); got != tc.want {
			t.Errorf("FromE4M3(%#02x) = %v, want %v", tc.code, got, tc.want)
		}
	}
}

// TestE4M3RoundTripsEveryCode: every non-NaN code encodes back to itself
// (-0 included); the NaN codes encode to NaN of the same sign.
func TestE4M3RoundTripsEveryCode(t *testing.T) {
	for c := range 256 {
		if got := E4M3(FromE4M3(uint8(c))); got != uint8(c) {
			t.Errorf("E4M3(FromE4M3(%#02x) = %v) = %#02x", c, FromE4M3(uint8(c)), got)
		}
	}
}

// TestE4M3Midpoints: between every two neighbouring finite codes, the exact
// midpoint goes to the even code and the float32 values just beside it go to
// the nearer code; for both signs.
func TestE4M3Midpoints(t *testing.T) {
	for c := uint8(0); c < MaxCodeE4M3; c++ {
		lo, hi := FromE4M3(c), FromE4M3(c+1)
		mid := (lo + hi) / 2 // exact: both have 4 significant bits
		even := c
		if c&1 == 1 {
			even = c + 1
		}
		for _, sign := range []uint8{0, 0x80} {
			s := float32(1)
			if sign != 0 {
				s = -1
			}
			cases := []struct {
				in   float32
				want uint8
			}{
				{s * mid, sign | even},
				{s * math.Nextafter32(mid, 0), sign | c},
				{s * math.Nextafter32(mid, 1000), sign | (c + 1)},
			}
			for _, tc := range cases {
				if got := E4M3(tc.in); got != tc.want {
					t.Errorf("E4M3(%v) = %#02x, want %#02x (between %#02x=%v and %#02x=%v)", tc.in, got, tc.want, c, lo, c+1, hi)
				}
			}
		}
	}
}

func TestE4M3Boundaries(t *testing.T) {
	inf := float32(math.Inf(1))
	nan := float32(math.NaN())
	for _, tc := range []struct {
		name string
		in   float32
		want uint8
	}{
		{"zero", 0, 0x00},
		{"negative zero", float32(math.Copysign(0, -1)), 0x80},
		{"max", 448, 0x7e},
		{"just above max", math.Nextafter32(448, inf), 0x7e},
		{"midpoint to 480 saturates", 464, 0x7e},
		{"above 464 saturates", 465, 0x7e},
		{"480 saturates", 480, 0x7e},
		{"huge saturates", 1e30, 0x7e},
		{"max float32", math.MaxFloat32, 0x7e},
		{"-huge saturates", -1e30, 0xfe},
		{"+inf saturates", inf, 0x7e},
		{"-inf saturates", -inf, 0xfe},
		{"NaN", nan, 0x7f},
		{"-NaN", float32(math.Copysign(float64(nan), -1)), 0xff},
		{"416 (odd mantissa 101) stays", 416, 0x7d},
		{"432: tie between 416 and 448 goes to even 448", 432, 0x7e},
		{"smallest normal", 1.0 / 64, 0x08},
		{"just below smallest normal", math.Nextafter32(1.0/64, 0), 0x08},
		{"7.5/512: tie between 7/512 and 8/512 goes to even 8", 7.5 / 512, 0x08},
		{"6.5/512: tie goes to even 6", 6.5 / 512, 0x06},
		{"smallest subnormal", 1.0 / 512, 0x01},
		{"half the smallest subnormal: tie to 0", 0.5 / 512, 0x00},
		{"just above half the smallest subnormal", math.Nextafter32(0.5/512, 1), 0x01},
		{"-just above half the smallest subnormal", -math.Nextafter32(0.5/512, 1), 0x81},
		{"1.5/512: tie goes to even 2", 1.5 / 512, 0x02},
		{"float32 subnormal", math.SmallestNonzeroFloat32, 0x00},
		{"-float32 subnormal", -math.SmallestNonzeroFloat32, 0x80},
		{"one", 1, 0x38},
		{"1.0625: tie between 1 and 1.125 goes to 1", 1.0625, 0x38},
		{"1.1875: tie between 1.125 and 1.25 goes to 1.25", 1.1875, 0x3a},
		{"1.9375 rounds up into the next binade", 1.9375, 0x40},
		{"-3.3", -3.3, 0xc5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := E4M3(tc.in); got != tc.want {
				t.Errorf("E4M3(%v) = %#02x (%v), want %#02x (%v)", tc.in, got, FromE4M3(got), tc.want, FromE4M3(tc.want))
			}
		})
	}
}

// torchE4M3 is PyTorch's c10 fp8e4m3fn_from_fp32_value (Float8_e4m3fn.h), the
// CPU conversion behind .to(torch.float8_e4m3fn), rewritten in Go as an
// independent oracle: it gives NaN (0x7f) for |f| >= 480 and rounds values in
// (464, 480) up to the NaN code too.
func torchE4M3(f float32) uint8 {
	const fp8Max = uint32(1087) << 20    // 480.0f
	const denormMask = uint32(141) << 23 // ((127-7) + (23-3) + 1) << 23
	bits := math.Float32bits(f)
	sign := bits & 0x80000000
	bits ^= sign
	var result uint8
	switch {
	case bits >= fp8Max:
		result = 0x7f
	case bits < uint32(121)<<23:
		bits = math.Float32bits(math.Float32frombits(bits) + math.Float32frombits(denormMask))
		result = uint8(bits - denormMask)
	default:
		mantOdd := (bits >> 20) & 1
		bits += 0xc407ffff // uint32((7-127) << 23) + 0x7ffff: wraps, as the unsigned C does
		bits += mantOdd
		result = uint8(bits >> 20)
	}
	return result | uint8(sign>>24)
}

// clampedTorchE4M3 is what the quantizers do: clamp to [-448, 448], then
// PyTorch's cast.
func clampedTorchE4M3(f float32) uint8 {
	if !math.IsNaN(float64(f)) {
		f = min(max(f, -MaxE4M3), MaxE4M3)
	}
	return torchE4M3(f)
}

// testFloats returns float32 values that exercise every rounding case of
// every E4M3 binade and beyond: for exponents from well below the subnormals
// to well above 448, every 3-bit top of the mantissa combined with low 20 bits
// that are zero, one, just below, at and above half-way, and all ones; both signs; plus random bits.
func testFloats() []float32 {
	var out []float32
	lows := []uint32{0, 1, 0x3ffff, 0x40000, 0x40001, 0x7ffff, 0x80000, 0x80001, 0xfffff}
	for e := uint32(100); e <= 140; e++ {
		for top := uint32(0); top < 8; top++ {
			for _, low := range lows {
				for _, s := range []uint32{0, 0x80000000} {
					out = append(out, math.Float32frombits(s|e<<23|top<<20|low))
				}
			}
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 200000 {
		out = append(out, math.Float32frombits(r.Uint32()))
		out = append(out, float32(r.NormFloat64()*math.Ldexp(1, r.IntN(24)-14)))
	}
	return out
}

// TestE4M3MatchesPyTorch: E4M3 equals clamp-then-PyTorch-cast on every test
// float (NaNs compared as NaN of the same sign), and equals PyTorch's bare
// cast wherever that one is finite, that is below 464 in magnitude.
func TestE4M3MatchesPyTorch(t *testing.T) {
	bad := 0
	for _, f := range testFloats() {
		got, want := E4M3(f), clampedTorchE4M3(f)
		if got != want {
			bad++
			if bad <= 10 {
				t.Errorf("E4M3(%v = %#08x) = %#02x, clamp + PyTorch cast gives %#02x", f, math.Float32bits(f), got, want)
			}
		}
		if a := math.Abs(float64(f)); a <= 464 && got != torchE4M3(f) {
			t.Errorf("E4M3(%v) = %#02x, PyTorch's cast gives %#02x", f, got, torchE4M3(f))
		}
	}
	if bad > 10 {
		t.Errorf("%d mismatches in all", bad)
	}
}

// TestE4M3IsNearest checks E4M3 against a brute-force search: the finite
// code nearest in value, ties to the even code, for values in range.
func TestE4M3IsNearest(t *testing.T) {
	for _, f := range testFloats() {
		a := math.Abs(float64(f))
		if math.IsNaN(a) || a > MaxE4M3 {
			continue
		}
		best, bestD := uint8(0), math.Inf(1)
		for c := uint8(0); c <= MaxCodeE4M3; c++ {
			d := math.Abs(a - float64(FromE4M3(c)))
			if d < bestD || (d == bestD && c&1 == 0) {
				best, bestD = c, d
			}
		}
		if math.Signbit(float64(f)) {
			best |= 0x80
		}
		if got := E4M3(f); got != best {
			t.Fatalf("E4M3(%v) = %#02x (%v), nearest is %#02x (%v)", f, got, FromE4M3(got), best, FromE4M3(best))
		}
	}
}
