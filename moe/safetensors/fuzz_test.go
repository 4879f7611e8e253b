package safetensors

import "testing"

// FuzzHeader: Parse never panics or hangs on any input, and whatever it accepts
// is self-consistent: every tensor lies inside the data section and converts
// (float dtypes) without error.
func FuzzHeader(f *testing.F) {
	f.Add(header(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, 4))
	f.Add(header(`{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,1],"data_offsets":[0,4]},"b":{"dtype":"U32","shape":[],"data_offsets":[4,8]}}`, 8))
	f.Add(header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, 2))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := Parse(data)
		if err != nil {
			return
		}
		dataSize := int64(len(data)) - h.DataOffset
		for name, ti := range h.Tensors {
			if ti.Begin < 0 || ti.End < ti.Begin || ti.End > dataSize {
				t.Fatalf("tensor %q: [%d,%d) outside the %d-byte data section", name, ti.Begin, ti.End, dataSize)
			}
			if ti.DType.IsFloat() {
				out := make([]float32, ti.NumElements())
				if err := DecodeFloat32(out, data[h.DataOffset+ti.Begin:h.DataOffset+ti.End], ti.DType); err != nil {
					t.Fatalf("tensor %q accepted but does not decode: %v", name, err)
				}
			}
		}
	})
}
