package half

import (
	"math"
	"testing"
)

// BF16s splits large slices across goroutines; every element must still be
// converted exactly once, as BF16 does.
func TestBF16sLarge(t *testing.T) {
	for _, n := range []int{0, 1, parallelGrain - 1, 4*parallelGrain + 3} {
		src := make([]float32, n)
		for i := range src {
			src[i] = float32(math.Sin(float64(i))) * float32(i%977)
		}
		got := BF16s(src)
		if len(got) != n {
			t.Fatalf("n=%d: %d outputs", n, len(got))
		}
		for i, v := range src {
			if got[i] != BF16(v) {
				t.Fatalf("n=%d: element %d: %#x, want %#x", n, i, got[i], BF16(v))
			}
		}
	}
}
