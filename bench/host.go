package bench

import (
	"encoding/binary"
	"math"
	"math/rand/v2"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
)

// Encode returns x in dtype t as little-endian bytes.
func Encode(x []float32, t gpuctx.DType) []byte {
	out := make([]byte, len(x)*t.Size())
	for i, v := range x {
		switch t {
		case gpuctx.F32:
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
		case gpuctx.F64:
			binary.LittleEndian.PutUint64(out[8*i:], math.Float64bits(float64(v)))
		case gpuctx.BF16:
			binary.LittleEndian.PutUint16(out[2*i:], half.BF16(v))
		case gpuctx.F16:
			binary.LittleEndian.PutUint16(out[2*i:], half.F16(v))
		}
	}
	return out
}

// Decode reads element i of b in dtype t.
func Decode(b []byte, i int, t gpuctx.DType) float64 {
	switch t {
	case gpuctx.F32:
		return float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
	case gpuctx.F64:
		return math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
	case gpuctx.BF16:
		return float64(half.FromBF16(binary.LittleEndian.Uint16(b[2*i:])))
	case gpuctx.F16:
		return float64(half.FromF16(binary.LittleEndian.Uint16(b[2*i:])))
	}
	return math.NaN()
}

// RandVec returns n standard normal values.
func RandVec(r *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	return x
}
