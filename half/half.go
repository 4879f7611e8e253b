// Package half converts between float32 and the 16-bit floating-point formats
// gpuctx stores on devices: bfloat16 (bf16) and IEEE 754 binary16 (f16).
// Conversions to 16 bits round to nearest, ties to even; NaN stays NaN.
package half

import (
	"math"
	"runtime"
	"sync"

	"github.com/x448/float16"
)

// BF16 returns the bfloat16 bits nearest to f (ties to even).
func BF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it a quiet NaN
		return uint16(b>>16) | 0x40
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

// FromBF16 returns the float32 value of bfloat16 bits h (exact).
func FromBF16(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F16 returns the IEEE binary16 bits nearest to f (ties to even).
func F16(f float32) uint16 { return uint16(float16.Fromfloat32(f)) }

// FromF16 returns the float32 value of binary16 bits h (exact).
func FromF16(h uint16) float32 { return float16.Frombits(h).Float32() }

// BF16s converts a slice (see BF16). Large slices are converted by several
// goroutines (weights of a whole layer are gigabytes).
func BF16s(src []float32) []uint16 {
	out := make([]uint16, len(src))
	parallel(len(src), func(lo, hi int) {
		d, s := out[lo:hi], src[lo:hi]
		for i, v := range s {
			d[i] = BF16(v)
		}
	})
	return out
}

// FromBF16Bytes converts len(dst) little-endian bf16 values in src (2*len(dst)
// bytes) to float32, exactly, on several goroutines for large slices.
func FromBF16Bytes(dst []float32, src []byte) {
	parallel(len(dst), func(lo, hi int) {
		d, s := dst[lo:hi], src[2*lo:2*hi]
		for i := range d { // byte loads the compiler keeps free of bounds checks
			d[i] = math.Float32frombits(uint32(s[2*i])<<16 | uint32(s[2*i+1])<<24)
		}
	})
}

// parallelGrain is the fewest elements worth a goroutine of their own.
const parallelGrain = 1 << 18

// parallel calls fn on disjoint ranges covering [0, n), on up to GOMAXPROCS
// goroutines when n is large, and returns when all have returned.
func parallel(n int, fn func(lo, hi int)) {
	parts := min(runtime.GOMAXPROCS(0), n/parallelGrain)
	if parts <= 1 {
		fn(0, n)
		return
	}
	// No errors to collect, so a WaitGroup rather than an errgroup.
	var wg sync.WaitGroup
	for p := range parts {
		lo, hi := n*p/parts, n*(p+1)/parts
		wg.Go(func() { fn(lo, hi) })
	}
	wg.Wait()
}

// F16s converts a slice (see F16).
func F16s(src []float32) []uint16 {
	out := make([]uint16, len(src))
	for i, v := range src {
		out[i] = F16(v)
	}
	return out
}
