package moekernels

import (
	"math"
	"testing"
	"unsafe"

	"github.com/gpuctx/gpuctx"
)

// The twin tests run the kernels through the public API on the CPU backend,
// which runs the Go bodies registered by this package.

// device is a CPU device of its own runtime, with the buffers the test
// allocated by address.
type device struct {
	dev  *gpuctx.Device
	bufs map[Ptr]*gpuctx.Buffer
}

// newTestDevice opens a fresh CPU runtime (a failed kernel loses its device)
// and closes it when the test ends.
func newTestDevice(t testing.TB) *device {
	t.Helper()
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatalf("OpenBackend(cpu): %v", err)
	}
	t.Cleanup(func() { _ = rt.Close() }) // a device lost to a failed kernel may report it again
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatalf("Device(0): %v", err)
	}
	return &device{dev: dev, bufs: map[Ptr]*gpuctx.Buffer{}}
}

// Alloc allocates n bytes and returns their address.
func (d *device) Alloc(n int) (Ptr, error) {
	b, err := d.dev.Alloc(n)
	if err != nil {
		return 0, err
	}
	p, err := b.Ptr()
	if err != nil {
		return 0, err
	}
	d.bufs[Ptr(p)] = b
	return Ptr(p), nil
}

var one = gpuctx.Dim3{X: 1, Y: 1, Z: 1}

func mustKernel(t testing.TB, d *device, name string) *gpuctx.Kernel {
	t.Helper()
	k, err := d.dev.Kernel(name)
	if err != nil {
		t.Fatalf("Kernel(%q): %v", name, err)
	}
	return k
}

func upload(t testing.TB, d *device, b []byte) Ptr {
	t.Helper()
	p, err := d.Alloc(len(b))
	if err != nil {
		t.Fatalf("Alloc(%d): %v", len(b), err)
	}
	if err := d.bufs[p].CopyFromHost(b); err != nil {
		t.Fatalf("CopyFromHost: %v", err)
	}
	return p
}

// download copies the first n bytes of the buffer allocated at p.
func download(t testing.TB, d *device, p Ptr, n int) []byte {
	t.Helper()
	b, ok := d.bufs[p]
	if !ok {
		t.Fatalf("download: %#x is not a buffer of this test", uintptr(p))
	}
	out := make([]byte, n)
	if n == 0 {
		return out
	}
	if n < b.Size() {
		var err error
		if b, err = b.Slice(0, n); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.CopyToHost(out); err != nil {
		t.Fatalf("CopyToHost: %v", err)
	}
	return out
}

func asBytes[T any](v []T) []byte {
	var zero T
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), len(v)*int(unsafe.Sizeof(zero)))
}

// fromBytes copies b into a new []T (the copy guarantees T's alignment).
func fromBytes[T any](b []byte) []T {
	var zero T
	out := make([]T, len(b)/int(unsafe.Sizeof(zero)))
	copy(asBytes(out), b)
	return out
}

// lcg is a deterministic generator of values in [-1, 1).
type lcg uint64

func (r *lcg) next() float64 {
	*r = *r*6364136223846793005 + 1442695040888963407
	return float64(*r>>11)/float64(1<<53)*2 - 1
}

func (r *lcg) vals(n int) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = r.next()
	}
	return v
}

// relErr is max|got-want| / max|want| (or the absolute error when want is 0).
func relErr(got, want []float64) float64 {
	var num, den float64
	for i := range want {
		num = math.Max(num, math.Abs(got[i]-want[i]))
		den = math.Max(den, math.Abs(want[i]))
	}
	if den == 0 {
		return num
	}
	return num / den
}
