// Package conformance is a backend-neutral test suite for gpuctx devices, in
// the manner of gonum's blas/testblas: an ordinary package whose exported test
// functions take a *testing.T and a *gpuctx.Device, so that every backend (the
// CPU backend in CI, CUDA on the GPU machine) runs exactly the same cases.
//
// It is what a new backend must pass: memory and copies, kernels, stream
// ordering and events, BLAS operations (Gemm, strided batched with distinct
// strides, grouped with empty groups, Geam; every type pair gpuctx accepts,
// both layouts, every transpose, padded leading dimensions), Context binding
// (one Context switched back and forth between two streams under both handle
// policies; concurrent views on their own streams), per-stream workspaces (no
// two streams on one workspace, checked by the backend's detector where it has
// one, by exact results everywhere), graph capture and replay (on another
// stream, after the capturing stream closed, beside eager work) and the error
// sentinels. Every BLAS answer is exact (small integers, alpha and beta powers
// of two) and checked against a float64 reference of this package's own or a
// hand-computed value, and every case checks that its inputs are unchanged. A
// type combination, BlasLt or graph capture that the backend reports as
// ErrUnavailable is logged and skipped, not failed.
//
// Run runs every case as a subtest; the individual TestX functions can be run on
// their own. Each case makes its own streams, events and buffers, releases them
// with t.Cleanup, and checks every result against a host computation; random
// inputs come from a generator seeded with a hash of the subtest's name, so a
// failure reproduces with the same -run pattern.
//
// The functions never close dev (TestErrors opens separate Runtimes for the
// closed-device and wrong-device cases), so a caller may run Run and then use
// dev further. They are not meant to run in parallel with each other on the
// same device: a few cases call Device.Synchronize during cleanup.
package conformance

import (
	"bytes"
	"encoding/binary"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// Case is one named conformance test.
type Case struct {
	Name string
	Test func(t *testing.T, dev *gpuctx.Device)
}

// Cases lists every conformance test in the order Run runs them.
func Cases() []Case {
	return []Case{
		{"AllocFree", TestAllocFree},
		{"SyncCopies", TestSyncCopies},
		{"AsyncCopies", TestAsyncCopies},
		{"Memset", TestMemset},
		{"Kernels", TestKernels},
		{"StreamOrdering", TestStreamOrdering},
		{"EventDependency", TestEventDependency},
		{"EventElapsed", TestEventElapsed},
		{"BlasGemm", TestBlasGemm},
		{"BlasStridedBatched", TestBlasStridedBatched},
		{"BlasGrouped", TestBlasGrouped},
		{"BlasGeam", TestBlasGeam},
		{"BlasExtents", TestBlasExtents},
		{"ContextStreamSwitching", TestContextStreamSwitching},
		{"ContextConcurrentViews", TestContextConcurrentViews},
		{"GraphReplay", TestGraphReplay},
		{"Errors", TestErrors},
	}
}

// Run runs every conformance test against dev, each as a subtest of t. It logs
// the backend and device it runs on. It blocks until every case is done and
// leaves dev open.
func Run(t *testing.T, dev *gpuctx.Device) {
	t.Helper()
	if dev == nil {
		t.Fatal("conformance.Run: nil device; open one with gpuctx.Open and Runtime.Device(0)")
	}
	info := dev.Info()
	t.Logf("conformance: backend %s, device %d %q (compute %d.%d, %d SMs, %d MiB)",
		dev.Backend(), info.Index, info.Name, info.ComputeMajor, info.ComputeMinor, info.SMCount, info.TotalMemory>>20)
	for _, c := range Cases() {
		t.Run(c.Name, func(t *testing.T) { c.Test(t, dev) })
	}
}

// onGPU reports whether dev is a real accelerator; cases then use larger sizes
// so that kernels run long enough for ordering bugs to show.
//
// A backend over fake vendor tables that run on host memory (backend/rocm's
// tests name their device "... (host memory)") is no GPU either: GPU-sized
// chains there only make the suite slow.
func onGPU(dev *gpuctx.Device) bool {
	return dev.Backend() != "cpu" && !strings.HasSuffix(dev.Info().Name, "(host memory)")
}

// newRand returns a generator seeded from t's full name: reproducible per subtest.
func newRand(t *testing.T) *rand.Rand {
	h := fnv.New64a()
	h.Write([]byte(t.Name()))
	return rand.New(rand.NewPCG(h.Sum64(), 0x9e3779b97f4a7c15))
}

func randBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// randInts returns n float32 holding integers in [lo, hi], so that sums and
// products of small numbers are exact and results can be compared bit for bit.
func randInts(r *rand.Rand, n, lo, hi int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(lo + r.IntN(hi-lo+1))
	}
	return v
}

func f32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func bytesF32(b []byte) []float32 {
	v := make([]float32, len(b)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return v
}

func i32Bytes(v []int32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
	return b
}

func bytesI32(b []byte) []int32 {
	v := make([]int32, len(b)/4)
	for i := range v {
		v[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return v
}

// launchDims returns a 1-D launch covering n elements with 256-thread blocks
// (the kernels are grid-stride, so a capped grid still covers everything).
func launchDims(n int) (grid, block gpuctx.Dim3) {
	g := min(max((n+255)/256, 1), 4096)
	return gpuctx.Dim3{X: g, Y: 1, Z: 1}, gpuctx.Dim3{X: 256, Y: 1, Z: 1}
}

func dim(x int) gpuctx.Dim3 { return gpuctx.Dim3{X: x, Y: 1, Z: 1} }

// alloc returns n bytes of device memory, freed (after a device synchronise) at
// cleanup unless the test freed it already.
func alloc(t *testing.T, dev *gpuctx.Device, n int) *gpuctx.Buffer {
	t.Helper()
	b, err := dev.Alloc(n)
	if err != nil {
		t.Fatalf("Device.Alloc(%d): %v", n, err)
	}
	t.Cleanup(func() {
		_ = dev.Synchronize()
		_ = b.Free() // ErrFreed when the test freed it: fine
	})
	return b
}

func allocHost(t *testing.T, dev *gpuctx.Device, n int) *gpuctx.HostBuffer {
	t.Helper()
	h, err := dev.AllocHost(n)
	if err != nil {
		t.Fatalf("Device.AllocHost(%d): %v", n, err)
	}
	t.Cleanup(func() {
		_ = dev.Synchronize()
		_ = h.Free()
	})
	return h
}

func newStream(t *testing.T, dev *gpuctx.Device) *gpuctx.Stream {
	t.Helper()
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatalf("Device.NewStream: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Stream.Close: %v", err)
		}
	})
	return s
}

func newEvent(t *testing.T, dev *gpuctx.Device, timing bool) *gpuctx.Event {
	t.Helper()
	e, err := dev.NewEvent(timing)
	if err != nil {
		t.Fatalf("Device.NewEvent(%v): %v", timing, err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

func kernel(t *testing.T, dev *gpuctx.Device, name string) *gpuctx.Kernel {
	t.Helper()
	k, err := dev.Kernel(name)
	if err != nil {
		t.Fatalf("Device.Kernel(%q): %v", name, err)
	}
	if k.Name() != name {
		t.Fatalf("Kernel.Name() = %q, want %q", k.Name(), name)
	}
	return k
}

// upload copies b into a new device buffer synchronously.
func upload(t *testing.T, dev *gpuctx.Device, b []byte) *gpuctx.Buffer {
	t.Helper()
	buf := alloc(t, dev, len(b))
	if err := buf.CopyFromHost(b); err != nil {
		t.Fatalf("Buffer.CopyFromHost(%d bytes): %v", len(b), err)
	}
	return buf
}

// download copies b to the host synchronously (after synchronising the device).
func download(t *testing.T, dev *gpuctx.Device, b *gpuctx.Buffer) []byte {
	t.Helper()
	if err := dev.Synchronize(); err != nil {
		t.Fatalf("Device.Synchronize: %v", err)
	}
	out := make([]byte, b.Size())
	if err := b.CopyToHost(out); err != nil {
		t.Fatalf("Buffer.CopyToHost(%d bytes): %v", b.Size(), err)
	}
	return out
}

func must(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// sameBytes reports the first difference between got and want.
func sameBytes(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: got %d bytes, want %d", what, len(got), len(want))
	}
	if bytes.Equal(got, want) {
		return
	}
	bad := 0
	first := -1
	for i := range got {
		if got[i] != want[i] {
			if first < 0 {
				first = i
			}
			bad++
		}
	}
	t.Fatalf("%s: %d of %d bytes differ; first at byte %d: got %#02x, want %#02x", what, bad, len(got), first, got[first], want[first])
}

func sameF32(t *testing.T, what string, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: got %d values, want %d", what, len(got), len(want))
	}
	for i := range got {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s: element %d of %d: got %v, want %v", what, i, len(got), got[i], want[i])
		}
	}
}

func filled(n int, v byte) []byte { return bytes.Repeat([]byte{v}, n) }
