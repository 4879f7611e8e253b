package conformance

import (
	"fmt"
	"math"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// launchShape is one grid/block choice; the kernels are grid-stride loops, so
// every shape must cover every element exactly once.
type launchShape struct {
	name        string
	grid, block gpuctx.Dim3
}

func launchShapes(n int) []launchShape {
	g, b := launchDims(n)
	return []launchShape{
		{"1x1", dim(1), dim(1)},
		{"1x256", dim(1), dim(256)},
		{"3x64", dim(3), dim(64)},
		{"7x33", dim(7), dim(33)},
		{"covering", g, b},
	}
}

// kernelTail is how many elements past n every kernel test allocates and
// poisons: a kernel that writes past n corrupts them.
const kernelTail = 64

// TestKernels launches each basic kernel of package kernels (gpuctx_empty,
// gpuctx_fill_f32, gpuctx_axpby_f32, gpuctx_add_i32) for several element counts
// and launch shapes on a fresh stream, and checks every element, and that the
// elements past n stay untouched, against a host computation.
func TestKernels(t *testing.T, dev *gpuctx.Device) {
	t.Run("empty", func(t *testing.T) {
		k := kernel(t, dev, "gpuctx_empty")
		s := newStream(t, dev)
		for _, sh := range launchShapes(1 << 16) {
			must(t, "Launch gpuctx_empty "+sh.name, s.Launch(k, sh.grid, sh.block, 0))
		}
		must(t, "Synchronize", s.Synchronize())
		if done, err := s.Query(); err != nil || !done {
			t.Errorf("Stream.Query after Synchronize = %v, %v; want true, nil", done, err)
		}
	})
	sizes := []int{1, 255, 256, 257, 100003}
	for _, n := range sizes {
		for _, sh := range launchShapes(n) {
			t.Run(fmt.Sprintf("fill_f32/n=%d/%s", n, sh.name), func(t *testing.T) {
				testFill(t, dev, n, sh)
			})
			t.Run(fmt.Sprintf("axpby_f32/n=%d/%s", n, sh.name), func(t *testing.T) {
				testAxpby(t, dev, n, sh)
			})
			t.Run(fmt.Sprintf("add_i32/n=%d/%s", n, sh.name), func(t *testing.T) {
				testAddI32(t, dev, n, sh)
			})
		}
	}
}

func testFill(t *testing.T, dev *gpuctx.Device, n int, sh launchShape) {
	r := newRand(t)
	k := kernel(t, dev, "gpuctx_fill_f32")
	s := newStream(t, dev)
	y := alloc(t, dev, 4*(n+kernelTail))
	must(t, "Memset", s.Memset(y, 0xff))
	v := float32(r.NormFloat64())
	must(t, "Launch", s.Launch(k, sh.grid, sh.block, 0, y, v, int64(n)))
	must(t, "Synchronize", s.Synchronize())
	got := bytesF32(download(t, dev, y))
	want := make([]float32, n+kernelTail)
	for i := range want {
		want[i] = v
		if i >= n {
			want[i] = math.Float32frombits(0xffffffff)
		}
	}
	sameF32(t, "gpuctx_fill_f32 result", got, want)
}

func testAxpby(t *testing.T, dev *gpuctx.Device, n int, sh launchShape) {
	r := newRand(t)
	k := kernel(t, dev, "gpuctx_axpby_f32")
	s := newStream(t, dev)
	x := make([]float32, n+kernelTail)
	y0 := make([]float32, n+kernelTail)
	for i := range x {
		x[i] = float32(r.NormFloat64())
		y0[i] = float32(r.NormFloat64())
	}
	a, b := float32(r.NormFloat64()), float32(r.NormFloat64())
	xb := upload(t, dev, f32Bytes(x))
	yb := upload(t, dev, f32Bytes(y0))
	must(t, "Launch", s.Launch(k, sh.grid, sh.block, 0, yb, xb, a, b, int64(n)))
	must(t, "Synchronize", s.Synchronize())
	got := bytesF32(download(t, dev, yb))
	for i := range got {
		if i >= n {
			if math.Float32bits(got[i]) != math.Float32bits(y0[i]) {
				t.Fatalf("element %d past n=%d was written: got %v, want %v untouched", i, n, got[i], y0[i])
			}
			continue
		}
		// A device may fuse a*x + b*y into one FMA: allow a few ulps of the terms.
		ax, by := float64(a)*float64(x[i]), float64(b)*float64(y0[i])
		want := ax + by
		tol := 4 * float64(math.Nextafter32(1, 2)-1) * (math.Abs(ax) + math.Abs(by))
		if d := math.Abs(float64(got[i]) - want); d > tol {
			t.Fatalf("element %d of %d: got %v, want %v (a=%v x=%v b=%v y=%v; |diff| %g > tol %g)",
				i, n, got[i], want, a, x[i], b, y0[i], d, tol)
		}
	}
}

func testAddI32(t *testing.T, dev *gpuctx.Device, n int, sh launchShape) {
	r := newRand(t)
	k := kernel(t, dev, "gpuctx_add_i32")
	s := newStream(t, dev)
	y := make([]int32, n+kernelTail)
	for i := range y {
		y[i] = int32(r.IntN(1<<24) - 1<<23)
	}
	v := int32(r.IntN(1<<20) - 1<<19)
	yb := upload(t, dev, i32Bytes(y))
	must(t, "Launch", s.Launch(k, sh.grid, sh.block, 0, yb, v, int64(n)))
	// A second launch on the same stream must see the first one's result.
	must(t, "Launch (second)", s.Launch(k, sh.grid, sh.block, 0, yb, v, int64(n)))
	must(t, "Synchronize", s.Synchronize())
	got := bytesI32(download(t, dev, yb))
	for i := range got {
		want := y[i]
		if i < n {
			want += 2 * v
		}
		if got[i] != want {
			t.Fatalf("element %d (n=%d): got %d, want %d (y0 %d, v %d, added twice below n)", i, n, got[i], want, y[i], v)
		}
	}
}
