package safetensors

import (
	"encoding/binary"
	"testing"
)

// The BF16 decoder (bounds-check-free, on several goroutines for big chunks)
// matches the element-by-element definition at every size.
func TestDecodeBF16Large(t *testing.T) {
	for _, n := range []int{1, 7, 1<<18 + 1, 3<<18 + 5} { // past half's parallel grain (1<<18)
		src := make([]byte, 2*n)
		for i := range n {
			binary.LittleEndian.PutUint16(src[2*i:], uint16(i*2654435761>>7))
		}
		dst := make([]float32, n)
		if err := DecodeFloat32(dst, src, BF16); err != nil {
			t.Fatal(err)
		}
		for i := range n {
			if want := BF16ToFloat32(binary.LittleEndian.Uint16(src[2*i:])); dst[i] != want && !(dst[i] != dst[i] && want != want) {
				t.Fatalf("n=%d: element %d: %v, want %v", n, i, dst[i], want)
			}
		}
	}
}
