package cpu

import (
	"math"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/x448/float16"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// newTestDevice opens a fresh backend (so per-device counters start at zero)
// and closes it when the test ends.
func newTestDevice(t testing.TB) *device {
	t.Helper()
	b, err := Open()
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	dv, err := b.Device(0)
	if err != nil {
		t.Fatalf("Device(0): %v", err)
	}
	return dv.(*device)
}

func newTestStream(t testing.TB, d *device) *stream {
	t.Helper()
	s, err := d.NewStream(hal.StreamOptions{NonBlocking: true})
	if err != nil {
		t.Fatalf("NewStream: %v", err)
	}
	return s.(*stream)
}

func upload(t testing.TB, d *device, b []byte) hal.Ptr {
	t.Helper()
	p, err := d.Alloc(len(b))
	if err != nil {
		t.Fatalf("Alloc(%d): %v", len(b), err)
	}
	if err := d.CopyHtoD(p, unsafe.Pointer(unsafe.SliceData(b)), len(b)); err != nil {
		t.Fatalf("CopyHtoD: %v", err)
	}
	return p
}

func download(t testing.TB, d *device, p hal.Ptr, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if err := d.CopyDtoH(unsafe.Pointer(unsafe.SliceData(b)), p, n); err != nil {
		t.Fatalf("CopyDtoH: %v", err)
	}
	return b
}

func asBytes[T any](v []T) []byte {
	var zero T
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), len(v)*int(unsafe.Sizeof(zero)))
}

func ptrOf[T any](v []T) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(v)) }

// fromBytes copies b into a new []T (the copy guarantees T's alignment).
func fromBytes[T any](b []byte) []T {
	var zero T
	out := make([]T, len(b)/int(unsafe.Sizeof(zero)))
	copy(asBytes(out), b)
	return out
}

// encode stores vals as dtype dt (rounding to nearest even) and returns the
// bytes and the values actually stored.
func encode(dt hal.DType, vals []float64) ([]byte, []float64) {
	q := make([]float64, len(vals))
	switch dt {
	case hal.F32:
		v := make([]float32, len(vals))
		for i, x := range vals {
			v[i] = float32(x)
			q[i] = float64(v[i])
		}
		return asBytes(v), q
	case hal.F64:
		v := append([]float64(nil), vals...)
		return asBytes(v), v
	case hal.F16:
		v := make([]uint16, len(vals))
		for i, x := range vals {
			v[i] = float16.Fromfloat32(float32(x)).Bits()
			q[i] = float64(float16.Frombits(v[i]).Float32())
		}
		return asBytes(v), q
	case hal.BF16:
		v := make([]uint16, len(vals))
		for i, x := range vals {
			v[i] = f32ToBF16(float32(x))
			q[i] = float64(bf16ToF32(v[i]))
		}
		return asBytes(v), q
	}
	panic("encode: bad dtype")
}

func decode(dt hal.DType, b []byte) []float64 {
	var out []float64
	switch dt {
	case hal.F32:
		for _, x := range fromBytes[float32](b) {
			out = append(out, float64(x))
		}
	case hal.F64:
		out = fromBytes[float64](b)
	case hal.F16:
		for _, x := range fromBytes[uint16](b) {
			out = append(out, float64(float16.Frombits(x).Float32()))
		}
	case hal.BF16:
		for _, x := range fromBytes[uint16](b) {
			out = append(out, float64(bf16ToF32(x)))
		}
	}
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

// newGate returns a channel that test work blocks on; it is closed by the
// test or, at the latest, when the test ends (before the device is closed, so a
// failing test does not hang draining a blocked stream). Call it after
// newTestDevice.
func newGate(t testing.TB) (gate chan struct{}, open func()) {
	gate = make(chan struct{})
	var once sync.Once
	open = func() { once.Do(func() { close(gate) }) }
	t.Cleanup(open)
	return gate, open
}

// within runs fn and fails the test if it does not return within 10 s: a guard
// against deadlocks, never a way to make a test pass.
func within(t testing.TB, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not finish within 10s (deadlock?)", what)
	}
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
