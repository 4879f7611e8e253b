package cuda

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// testBackend is shared by the tests of this file: one Backend per process,
// opened on first use.
var testBackend = struct {
	once sync.Once
	b    hal.Backend
	d    *device
	err  error
}{}

// gpu returns device 0, or skips the test with the loader's diagnosis when
// there is no usable CUDA device.
func gpu(t testing.TB) *device {
	t.Helper()
	testBackend.once.Do(func() {
		b, err := Open()
		if err != nil {
			testBackend.err = err
			return
		}
		d, err := b.Device(0)
		if err != nil {
			b.Close()
			testBackend.err = err
			return
		}
		testBackend.b, testBackend.d = b, d.(*device)
		fmt.Printf("backend cuda: %s (sm_%d%d, %d SMs), libraries %+v\n", d.Info().Name,
			d.Info().ComputeMajor, d.Info().ComputeMinor, d.Info().SMCount, b.Libraries())
	})
	if testBackend.err != nil {
		t.Skipf("CUDA backend unavailable, skipping: %v", testBackend.err)
	}
	return testBackend.d
}

// pinned allocates n elements of page-locked memory of type T, freed at cleanup.
func pinned[T any](t testing.TB, d *device, n int) []T {
	t.Helper()
	var z T
	p, err := d.AllocHost(n * int(unsafe.Sizeof(z)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.FreeHost(p); err != nil {
			t.Error(err)
		}
	})
	return unsafe.Slice((*T)(p), n)
}

func devAlloc(t testing.TB, d *device, n int) hal.Ptr {
	t.Helper()
	p, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Free(p); err != nil {
			t.Error(err)
		}
	})
	return p
}

func newStream(t testing.TB, d *device, o hal.StreamOptions) hal.Stream {
	t.Helper()
	s, err := d.NewStream(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Destroy() })
	return s
}

func mustKernel(t testing.TB, d *device, name string) hal.Kernel {
	t.Helper()
	k, err := d.Kernel(name)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// grid1D returns a grid that covers n elements with 256-thread blocks, capped
// (the kernels are grid-stride loops).
func grid1D(n int) hal.Dim3 { return hal.Dim3{X: min(max((n+255)/256, 1), 1024), Y: 1, Z: 1} }

var block256 = hal.Dim3{X: 256, Y: 1, Z: 1}

func TestDeviceInfo(t *testing.T) {
	d := gpu(t)
	b := testBackend.b
	info := d.Info()
	checks := []struct {
		what string
		ok   bool
	}{
		{"name set", info.Name != ""},
		{"compute capability >= 5.0", info.ComputeMajor >= 5 && info.ComputeMinor >= 0},
		{"SM count > 0", info.SMCount > 0},
		{"total memory > 0", info.TotalMemory > 0},
		{"L2 > 0", info.L2Bytes > 0},
		{"driver version >= 11000", info.DriverVersion >= 11000},
	}
	for _, c := range checks {
		if !c.ok {
			t.Errorf("%s: got %+v", c.what, info)
		}
	}
	free, total, err := d.MemInfo()
	if err != nil || free == 0 || free > total || total != info.TotalMemory {
		t.Errorf("MemInfo = %d, %d, %v (info total %d)", free, total, err, info.TotalMemory)
	}
	least, greatest := d.PriorityRange()
	if greatest > least {
		t.Errorf("PriorityRange = %d, %d; want greatest <= least", least, greatest)
	}
	again, err := b.Device(0)
	if err != nil || again != hal.Device(d) {
		t.Errorf("second Device(0) = %v, %v; want the same device", again, err)
	}
	for _, bad := range []int{-1, b.DeviceCount()} {
		if _, err := b.Device(bad); err == nil {
			t.Errorf("Device(%d) succeeded", bad)
		}
	}
	libs := b.Libraries()
	if len(libs) == 0 || libs[0].Name != "driver" || !strings.Contains(libs[0].Path, "libcuda") || libs[0].Version == "" {
		t.Errorf("Libraries()[0] = %+v; want the driver with path and version", libs)
	}
	if b.Name() != "cuda" {
		t.Errorf("Name() = %q", b.Name())
	}
}

func TestAllocFree(t *testing.T) {
	d := gpu(t)
	tests := []struct {
		name string
		n    int
		want error // nil: success
	}{
		{"one byte", 1, nil},
		{"4 KiB", 4096, nil},
		{"64 MiB", 64 << 20, nil},
		{"zero", 0, errAny},
		{"negative", -8, errAny},
		{"twice the device", int(min(d.Info().TotalMemory*2, math.MaxInt64/2)), ErrOutOfMemory},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := d.Alloc(tc.n)
			if tc.want != nil {
				if err == nil {
					d.Free(p)
					t.Fatalf("Alloc(%d) succeeded", tc.n)
				}
				if tc.want != errAny && !errors.Is(err, tc.want) {
					t.Fatalf("Alloc(%d) = %v, want %v", tc.n, err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p%256 != 0 {
				t.Errorf("Alloc(%d) = %#x, not 256-byte aligned", tc.n, uintptr(p))
			}
			if err := d.Free(p); err != nil {
				t.Fatal(err)
			}
			if err := d.Free(p); !errors.Is(err, hal.ErrBadPointer) {
				t.Errorf("double Free = %v, want hal.ErrBadPointer", err)
			}
		})
	}
	if err := d.FreeHost(unsafe.Pointer(new(byte))); !errors.Is(err, hal.ErrBadPointer) {
		t.Errorf("FreeHost of Go memory = %v, want hal.ErrBadPointer", err)
	}
}

// errAny marks a test case that wants some error.
var errAny = errors.New("any error")

func TestCopyRoundTrip(t *testing.T) {
	d := gpu(t)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{1, 1000, 1 << 20} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			src := make([]float32, n)
			for i := range src {
				src[i] = rng.Float32()
			}
			bytes := 4 * n
			a, b := devAlloc(t, d, bytes), devAlloc(t, d, bytes)

			// Synchronous copies with ordinary Go memory.
			got := make([]float32, n)
			if err := d.CopyHtoD(a, unsafe.Pointer(&src[0]), bytes); err != nil {
				t.Fatal(err)
			}
			if err := d.CopyDtoD(b, a, bytes); err != nil {
				t.Fatal(err)
			}
			if err := d.CopyDtoH(unsafe.Pointer(&got[0]), b, bytes); err != nil {
				t.Fatal(err)
			}
			compare(t, "sync", got, src)

			// Async copies through pinned memory on a non-blocking stream.
			s := newStream(t, d, hal.StreamOptions{NonBlocking: true})
			in, out := pinned[float32](t, d, n), pinned[float32](t, d, n)
			for i := range in {
				in[i] = rng.Float32()
			}
			steps := []error{
				s.MemsetAsync(b, 0, bytes),
				s.CopyHtoDAsync(a, unsafe.Pointer(&in[0]), bytes),
				s.CopyDtoDAsync(b, a, bytes),
				s.CopyDtoHAsync(unsafe.Pointer(&out[0]), b, bytes),
				s.Synchronize(),
			}
			if err := errors.Join(steps...); err != nil {
				t.Fatal(err)
			}
			compare(t, "async", out, in)

			// MemsetAsync sets bytes.
			ob := unsafe.Slice((*byte)(unsafe.Pointer(&out[0])), bytes)
			if err := errors.Join(s.MemsetAsync(b, 0xab, bytes), s.CopyDtoHAsync(unsafe.Pointer(&out[0]), b, bytes), s.Synchronize()); err != nil {
				t.Fatal(err)
			}
			for i, c := range ob {
				if c != 0xab {
					t.Fatalf("after MemsetAsync byte %d = %#x, want 0xab", i, c)
				}
			}
			done, err := s.Query()
			if err != nil || !done {
				t.Errorf("Query after Synchronize = %v, %v; want true", done, err)
			}
		})
	}
}

func compare[T comparable](t testing.TB, what string, got, want []T) {
	t.Helper()
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("%s: element %d = %v, want %v", what, i, got[i], want[i])
		}
	}
}

// TestKernels launches each kernel and checks every element.
func TestKernels(t *testing.T) {
	d := gpu(t)
	s := newStream(t, d, hal.StreamOptions{})
	const n = 100_003 // not a multiple of the block size
	y, x := devAlloc(t, d, 4*n), devAlloc(t, d, 4*n)
	host := pinned[float32](t, d, n)
	hostI := unsafe.Slice((*int32)(unsafe.Pointer(&host[0])), n)
	xs := make([]float32, n)
	for i := range xs {
		xs[i] = float32(i%1000) * 0.5
	}
	if err := d.CopyHtoD(x, unsafe.Pointer(&xs[0]), 4*n); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name  string
		setup func() error // queued on s before the launch
		args  []any
		check func(i int) (got, want any)
	}{
		{"gpuctx_empty", nil, nil, nil},
		{"gpuctx_fill_f32", nil, []any{y, float32(2.5), int64(n)},
			func(i int) (any, any) { return host[i], float32(2.5) }},
		{"gpuctx_axpby_f32", func() error { return launch(s, d, "gpuctx_fill_f32", n, y, float32(3), int64(n)) },
			[]any{y, x, float32(2), float32(-1), int64(n)},
			func(i int) (any, any) { return host[i], float32(2*xs[i] - 3) }},
		{"gpuctx_add_i32", func() error { return s.MemsetAsync(y, 0, 4*n) },
			[]any{y, int32(-7), int64(n)},
			func(i int) (any, any) { return hostI[i], int32(-7) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.setup != nil {
				if err := tc.setup(); err != nil {
					t.Fatal(err)
				}
			}
			k := mustKernel(t, d, tc.name)
			if k.Name() != tc.name {
				t.Errorf("Name() = %q", k.Name())
			}
			if err := s.Launch(k, grid1D(n), block256, 0, tc.args...); err != nil {
				t.Fatal(err)
			}
			if err := errors.Join(s.CopyDtoHAsync(unsafe.Pointer(&host[0]), y, 4*n), s.Synchronize()); err != nil {
				t.Fatal(err)
			}
			if tc.check == nil {
				return
			}
			for i := 0; i < n; i++ {
				if got, want := tc.check(i); got != want {
					t.Fatalf("element %d = %v, want %v", i, got, want)
				}
			}
		})
	}

	t.Run("bad launches", func(t *testing.T) {
		k := mustKernel(t, d, "gpuctx_fill_f32")
		kk := k.(*kernel)
		bad := []struct {
			name       string
			grid       hal.Dim3
			args       []any
			want       string
			needParams bool // only detectable with cuFuncGetParamInfo
		}{
			{"int instead of int64", grid1D(n), []any{y, float32(1), n}, "argument 2 has type int", false},
			{"zero grid", hal.Dim3{X: 0, Y: 1, Z: 1}, []any{y, float32(1), int64(n)}, "grid.X = 0", false},
			{"int32 for long long", grid1D(n), []any{y, float32(1), int32(n)}, "argument 2 is 4 bytes", true},
			{"missing argument", grid1D(n), []any{y, float32(1)}, "2 arguments given, the kernel takes 3", true},
		}
		for _, c := range bad {
			if c.needParams && kk.params == nil {
				t.Logf("%s: driver lacks cuFuncGetParamInfo, not checked", c.name)
				continue
			}
			err := s.Launch(k, c.grid, block256, 0, c.args...)
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "gpuctx_fill_f32") {
				t.Errorf("%s: Launch = %v, want an error naming the kernel and %q", c.name, err, c.want)
			}
		}
		if _, err := d.Kernel("gpuctx_no_such_kernel"); !errors.Is(err, hal.ErrNoKernel) {
			t.Errorf("Kernel(unknown) = %v, want hal.ErrNoKernel", err)
		}
		k2, err := d.Kernel("gpuctx_fill_f32")
		if err != nil || k2 != k {
			t.Errorf("second Kernel() = %v, %v; want the cached kernel", k2, err)
		}
	})
}

// TestLibrariesAfterUse checks that NVRTC (after a kernel was compiled) and
// cuBLAS (after the first BLAS handle) are listed with paths and versions.
func TestLibrariesAfterUse(t *testing.T) {
	d := gpu(t)
	mustKernel(t, d, "gpuctx_empty")
	h, err := d.NewBlasHandle()
	if errors.Is(err, dynload.ErrNotFound) {
		t.Logf("cuBLAS not installed, only NVRTC checked: %v", err)
	} else if err != nil {
		t.Fatalf("NewBlasHandle: %v", err)
	} else if err := h.Destroy(); err != nil {
		t.Fatal(err)
	}
	have := map[string]hal.Library{}
	for _, l := range testBackend.b.Libraries() {
		have[l.Name] = l
	}
	want := []string{"driver", "nvrtc"}
	if err == nil {
		want = append(want, "cublas")
	}
	for _, name := range want {
		l, ok := have[name]
		if !ok || l.Path == "" || l.Version == "" {
			t.Errorf("Libraries() lacks %s with path and version: %+v", name, have)
		}
	}
	t.Logf("libraries: %+v", have)
}

// launch queues kernel name over n elements on s.
func launch(s hal.Stream, d *device, name string, n int, args ...any) error {
	k, err := d.Kernel(name)
	if err != nil {
		return err
	}
	return s.Launch(k, grid1D(n), block256, 0, args...)
}

// TestStreamOrdering queues many dependent kernels and copies on one stream.
// The two update steps do not commute (h(g(y)) != g(h(y))), so any reordering
// changes the result, which is checked element by element against the same
// float32 arithmetic on the host.
func TestStreamOrdering(t *testing.T) {
	d := gpu(t)
	s := newStream(t, d, hal.StreamOptions{NonBlocking: true})
	const n, steps = 1 << 16, 400
	y, z, x := devAlloc(t, d, 4*n), devAlloc(t, d, 4*n), devAlloc(t, d, 4*n)
	host := pinned[float32](t, d, n)
	xs := make([]float32, n)
	for i := range xs {
		xs[i] = float32(i % 7)
	}
	copy(host, xs)
	if err := errors.Join(s.CopyHtoDAsync(x, unsafe.Pointer(&host[0]), 4*n), s.MemsetAsync(y, 0, 4*n)); err != nil {
		t.Fatal(err)
	}
	want := make([]float32, n)
	for i := 0; i < steps; i++ {
		// h: y = x + 0.5*y; g: y = y - 3x. Every 10 steps y goes through z by copy.
		a, b := float32(1), float32(0.5)
		if i%2 == 1 {
			a, b = -3, 1
		}
		if err := launch(s, d, "gpuctx_axpby_f32", n/(1+i%5), y, x, a, b, int64(n)); err != nil {
			t.Fatal(err)
		}
		for j := range want {
			want[j] = a*xs[j] + b*want[j]
		}
		if i%10 == 9 {
			if err := errors.Join(s.CopyDtoDAsync(z, y, 4*n), s.MemsetAsync(y, 0, 4*n), s.CopyDtoDAsync(y, z, 4*n)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := errors.Join(s.CopyDtoHAsync(unsafe.Pointer(&host[0]), y, 4*n), s.Synchronize()); err != nil {
		t.Fatal(err)
	}
	compare(t, "ordered chain", host, want)
}

// TestEventAcrossStreams: stream B waits on an event recorded after a long
// kernel chain on A, then reads A's result. Without the wait B would read a
// partial result.
func TestEventAcrossStreams(t *testing.T) {
	d := gpu(t)
	a := newStream(t, d, hal.StreamOptions{NonBlocking: true})
	b := newStream(t, d, hal.StreamOptions{NonBlocking: true})
	const n, chain = 1 << 20, 2000
	y := devAlloc(t, d, 4*n)
	host := pinned[int32](t, d, n)
	e, err := d.NewEvent(false)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Destroy()
	if err := a.MemsetAsync(y, 0, 4*n); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < chain; i++ {
		if err := launch(a, d, "gpuctx_add_i32", n, y, int32(1), int64(n)); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(e.Record(a), b.Wait(e), b.CopyDtoHAsync(unsafe.Pointer(&host[0]), y, 4*n), b.Synchronize()); err != nil {
		t.Fatal(err)
	}
	for i, v := range host {
		if v != chain {
			t.Fatalf("B read y[%d] = %d, want %d: B did not wait for A", i, v, chain)
		}
	}
	if done, err := e.Query(); err != nil || !done {
		t.Errorf("event Query after B synchronised = %v, %v", done, err)
	}
	if err := e.Synchronize(); err != nil {
		t.Error(err)
	}
}

func TestElapsed(t *testing.T) {
	d := gpu(t)
	s := newStream(t, d, hal.StreamOptions{})
	start, err := d.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	defer start.Destroy()
	end, err := d.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	defer end.Destroy()
	noTiming, err := d.NewEvent(false)
	if err != nil {
		t.Fatal(err)
	}
	defer noTiming.Destroy()

	const n = 1 << 22
	y := devAlloc(t, d, 4*n)
	if err := start.Record(s); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		if err := launch(s, d, "gpuctx_fill_f32", n, y, float32(i), int64(n)); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(end.Record(s), noTiming.Record(s), end.Synchronize()); err != nil {
		t.Fatal(err)
	}
	el, err := end.Elapsed(start)
	if err != nil {
		t.Fatal(err)
	}
	// 50 fills of 16 MiB write 800 MiB: at least ~0.1 ms on any GPU, and far
	// below a second.
	if el <= 0 || el.Seconds() > 1 {
		t.Errorf("Elapsed = %v, want a positive duration below 1s", el)
	}
	t.Logf("50 fills of %d floats: %v (%.0f GB/s)", n, el, 50*4*n/el.Seconds()/1e9)
	if _, err := noTiming.Elapsed(start); err == nil {
		t.Error("Elapsed with a non-timing event succeeded")
	}
}

func TestCompileErrorLog(t *testing.T) {
	nv, err := loadNVRTC()
	if err != nil {
		t.Skipf("NVRTC unavailable, skipping: %v", err)
	}
	const src = "extern \"C\" __global__ void gpuctx_broken(float* y) {\n  y[0] = undefined_name;\n}\n"
	major, minor := 8, 0
	if testBackend.d != nil {
		major, minor = testBackend.d.info.ComputeMajor, testBackend.d.info.ComputeMinor
	}
	_, _, err = nv.compileSource("broken.cu", src, major, minor, false)
	var ce *CompileError
	if !errors.As(err, &ce) {
		t.Fatalf("compiling broken source: err = %v (%T), want *CompileError", err, err)
	}
	if ce.Code != nvrtcCompilation || !strings.Contains(ce.Log, "undefined_name") || !strings.Contains(ce.Log, "broken.cu(2)") {
		t.Errorf("CompileError = %+v; want NVRTC_ERROR_COMPILATION with a log naming broken.cu(2) and undefined_name", ce)
	}
	msg := err.Error()
	for _, w := range []string{"NVRTC compiling broken.cu", "NVRTC_ERROR_COMPILATION (6)", "compiler log:\n", "undefined_name"} {
		if !strings.Contains(msg, w) {
			t.Errorf("message lacks %q:\n%s", w, msg)
		}
	}
	// A good source compiles (to CUBIN when NVRTC can).
	img, isPTX, err := nv.compileSource("basic.cu", kernelSources()["basic.cu"], major, minor, false)
	if err != nil || len(img) == 0 {
		t.Fatalf("compiling basic.cu: %d bytes, %v", len(img), err)
	}
	t.Logf("basic.cu for %d.%d: %d bytes, PTX=%v, NVRTC %s", major, minor, len(img), isPTX, nv.version)
}

// TestMigrationStress runs 64 goroutines x 1000 iterations of alloc, copy,
// launch, cross-stream event wait, copy back and free, with GOMAXPROCS >= 8
// and no LockOSThread here, so goroutines move between OS threads and every
// call must make the context current itself.
func TestMigrationStress(t *testing.T) {
	d := gpu(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(max(8, runtime.GOMAXPROCS(0))))
	goroutines, iters := 64, 1000
	if testing.Short() {
		iters = 50
	}
	const n = 1024
	k := mustKernel(t, d, "gpuctx_add_i32")
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := 0; g < goroutines; g++ {
		a := newStream(t, d, hal.StreamOptions{NonBlocking: g%2 == 0})
		b := newStream(t, d, hal.StreamOptions{NonBlocking: g%3 == 0})
		in, out := pinned[int32](t, d, n), pinned[int32](t, d, n)
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- stressWorker(d, k, a, b, in, out, g, iters)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

func stressWorker(d *device, k hal.Kernel, a, b hal.Stream, in, out []int32, g, iters int) error {
	const n = 1024
	e, err := d.NewEvent(false)
	if err != nil {
		return err
	}
	defer e.Destroy()
	for it := 0; it < iters; it++ {
		for i := range in {
			in[i] = int32(it*n + i)
		}
		p, err := d.Alloc(4 * n)
		if err != nil {
			return fmt.Errorf("goroutine %d iteration %d: %w", g, it, err)
		}
		err = errors.Join(
			a.CopyHtoDAsync(p, unsafe.Pointer(&in[0]), 4*n),
			a.Launch(k, hal.Dim3{X: 4, Y: 1, Z: 1}, hal.Dim3{X: 128, Y: 1, Z: 1}, 0, p, int32(g), int64(n)),
			e.Record(a),
			b.Wait(e),
			b.CopyDtoHAsync(unsafe.Pointer(&out[0]), p, 4*n),
			b.Synchronize(),
		)
		if ferr := d.Free(p); err == nil {
			err = ferr
		}
		if err != nil {
			return fmt.Errorf("goroutine %d iteration %d: %w", g, it, err)
		}
		for i := range out {
			if want := int32(it*n+i) + int32(g); out[i] != want {
				return fmt.Errorf("goroutine %d iteration %d: out[%d] = %d, want %d", g, it, i, out[i], want)
			}
		}
	}
	return nil
}

// TestClose checks Close releases and then refuses use, on a second Backend so
// the shared one stays open.
func TestClose(t *testing.T) {
	gpu(t)
	b, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	dv, err := b.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	d := dv.(*device)
	p, err := d.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.NewStream(hal.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	e, err := d.NewEvent(true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Kernel("gpuctx_empty"); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	after := []struct {
		name string
		err  error
	}{
		{"Alloc", func() error { _, err := d.Alloc(16); return err }()},
		{"Stream.Synchronize", s.Synchronize()},
		{"Event.Record", e.Record(s)},
		{"Device", func() error { _, err := b.Device(0); return err }()},
		{"Kernel", func() error { _, err := d.Kernel("gpuctx_empty"); return err }()},
	}
	for _, a := range after {
		if !errors.Is(a.err, hal.ErrClosed) {
			t.Errorf("%s after Close = %v, want hal.ErrClosed", a.name, a.err)
		}
	}
	if err := errors.Join(s.Destroy(), e.Destroy()); err != nil {
		t.Errorf("Destroy after Close = %v, want nil", err)
	}
	_ = p
}
