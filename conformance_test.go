package gpuctx_test

import (
	"encoding/binary"
	"fmt"
	"log"
	"math"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/conformance"
)

// openDevice opens device 0 of the named backend, closing the Runtime at
// cleanup. For "cuda" it skips (with the loader's diagnosis) when CUDA is not
// available; the CPU backend must always open.
func openDevice(t *testing.T, backend string) *gpuctx.Device {
	t.Helper()
	rt, err := gpuctx.OpenBackend(backend)
	if err != nil {
		if backend == "cpu" {
			t.Fatalf("gpuctx.OpenBackend(%q): %v", backend, err)
		}
		t.Skipf("backend %s not available here: %v", backend, err)
	}
	t.Cleanup(func() {
		if err := rt.Close(); err != nil {
			t.Errorf("Runtime.Close: %v", err)
		}
	})
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatalf("%s Runtime.Device(0): %v", backend, err)
	}
	info := dev.Info()
	t.Logf("backend %s: device %d %q, compute %d.%d, %d SMs, %d MiB, driver %d",
		rt.Backend(), info.Index, info.Name, info.ComputeMajor, info.ComputeMinor, info.SMCount, info.TotalMemory>>20, info.DriverVersion)
	return dev
}

// TestConformance runs the backend-neutral conformance suite on every backend
// available here: always the CPU backend, and CUDA when it loads.
func TestConformance(t *testing.T) {
	for _, backend := range []string{"cpu", "cuda"} {
		t.Run(backend, func(t *testing.T) {
			conformance.Run(t, openDevice(t, backend))
		})
	}
}

// Example_quickStart is the API example of README.md, compiled and run by go
// test so that the README stays accurate: open the backend, allocate, launch a
// kernel on a stream, and run a GEMM through a Context on that stream.
func Example_quickStart() {
	rt, err := gpuctx.Open() // $GPUCTX_BACKEND, else CUDA if it loads, else CPU
	if err != nil {
		log.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		log.Fatal(err)
	}
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		log.Fatal(err)
	}
	const m, n, k = 64, 32, 16
	a, _ := dev.Alloc(4 * m * k) // error checks elided from here on
	b, _ := dev.Alloc(4 * k * n)
	c, _ := dev.Alloc(4 * m * n)

	// Kernels are queued on s in order: fill A with 1 and B with 2.
	fill, _ := dev.Kernel("gpuctx_fill_f32")
	grid, block := gpuctx.Dim3{X: 8, Y: 1, Z: 1}, gpuctx.Dim3{X: 256, Y: 1, Z: 1}
	_ = s.Launch(fill, grid, block, 0, a, float32(1), int64(m*k))
	_ = s.Launch(fill, grid, block, 0, b, float32(2), int64(k*n))

	// The Context lends a BLAS handle bound to its current stream (s) for the
	// duration of the callback only: C = A*B runs on s, after the fills.
	ctx, _ := dev.NewContext(gpuctx.ContextOptions{Stream: s})
	defer ctx.Close()
	err = ctx.Blas(func(h gpuctx.Blas) error {
		return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, M: m, N: n, K: k, Alpha: 1,
			A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
	})
	if err != nil {
		log.Fatal(err)
	}
	out := make([]byte, c.Size())
	if err := s.Synchronize(); err != nil { // wait for the fills and the GEMM
		log.Fatal(err)
	}
	if err := c.CopyToHost(out); err != nil {
		log.Fatal(err)
	}
	fmt.Println("C[0][0] =", math.Float32frombits(binary.LittleEndian.Uint32(out)))
	// Output: C[0][0] = 32
}
