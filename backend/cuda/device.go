package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// device implements hal.Device and hal.Runner for one CUDA device's primary
// context.
type device struct {
	b    *backend
	api  *driverAPI
	dev  int32   // CUdevice
	ctx  uintptr // primary CUcontext
	info hal.DeviceInfo

	leastPrio, greatestPrio int

	closed atomic.Bool
	sticky stickyState // the first sticky error: the device is lost after it

	mu      sync.Mutex // guards the resource sets below
	mem     map[hal.Ptr]int
	host    map[unsafe.Pointer]int
	streams map[*stream]struct{}
	events  map[*event]struct{}
	handles []destroyer // BLAS and Lt handles made here

	// early: LaunchEarly uses programmatic dependent launch (compute
	// capability >= 9.0, cuLaunchKernelEx present, GPUCTX_EARLY_LAUNCH != "0").
	early bool

	modMu   sync.Mutex         // guards modules and kernels; held while loading a module
	modules map[string]uintptr // source file -> CUmodule
	kernels map[string]*kernel // kernel name -> function
}

// destroyer is a handle the device destroys at Close.
type destroyer interface{ Destroy() error }

// openDevice retains device i's primary context and reads its properties.
func openDevice(b *backend, i int) (*device, error) {
	api := b.api
	d := &device{
		b: b, api: api,
		mem:     map[hal.Ptr]int{},
		host:    map[unsafe.Pointer]int{},
		streams: map[*stream]struct{}{},
		events:  map[*event]struct{}{},
		modules: map[string]uintptr{},
		kernels: map[string]*kernel{},
	}
	if err := check(api, "cuDeviceGet", api.cuDeviceGet(&d.dev, int32(i))); err != nil {
		return nil, fmt.Errorf("cuda: Device(%d): %w", i, err)
	}
	var name [256]byte
	if err := check(api, "cuDeviceGetName", api.cuDeviceGetName(&name[0], int32(len(name)), d.dev)); err != nil {
		return nil, fmt.Errorf("cuda: Device(%d): %w", i, err)
	}
	attr := func(a int32) (int, error) {
		var v int32
		if err := check(api, "cuDeviceGetAttribute", api.cuDeviceGetAttribute(&v, a, d.dev)); err != nil {
			return 0, fmt.Errorf("cuda: Device(%d): attribute %d: %w", i, a, err)
		}
		return int(v), nil
	}
	var err error
	info := hal.DeviceInfo{Index: i, Name: cStringBuf(name[:]), DriverVersion: int(driver.version)}
	if info.ComputeMajor, err = attr(attrComputeCapability); err != nil {
		return nil, err
	}
	if info.ComputeMinor, err = attr(attrComputeCapability + 1); err != nil {
		return nil, err
	}
	if info.SMCount, err = attr(attrMultiprocessors); err != nil {
		return nil, err
	}
	if info.L2Bytes, err = attr(attrL2CacheSize); err != nil {
		return nil, err
	}
	var total uintptr
	if err := check(api, "cuDeviceTotalMem_v2", api.cuDeviceTotalMem(&total, d.dev)); err != nil {
		return nil, fmt.Errorf("cuda: Device(%d): %w", i, err)
	}
	info.TotalMemory = uint64(total)
	d.info = info
	d.early = info.ComputeMajor >= 9 && api.cuLaunchKernelEx != nil && os.Getenv("GPUCTX_EARLY_LAUNCH") != "0"

	if err := check(api, "cuDevicePrimaryCtxRetain", api.cuDevicePrimaryCtxRetain(&d.ctx, d.dev)); err != nil {
		return nil, fmt.Errorf("cuda: Device(%d): %w", i, err)
	}
	err = d.Do(func() error {
		var least, greatest int32
		if err := check(api, "cuCtxGetStreamPriorityRange", api.cuCtxGetStreamPriorityRange(&least, &greatest)); err != nil {
			return err
		}
		d.leastPrio, d.greatestPrio = int(least), int(greatest)
		return nil
	})
	if err != nil {
		api.cuDevicePrimaryCtxRelease(d.dev)
		return nil, fmt.Errorf("cuda: Device(%d): %w", i, err)
	}
	return d, nil
}

// cStringBuf returns the NUL-terminated string at the start of b.
func cStringBuf(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// Do runs fn on one OS thread with this device's primary context current: it
// locks the goroutine to its thread, makes the context current if another (or
// none) is, runs fn and unlocks. Every driver and library call that needs a
// context goes through Do. Do may be called from any goroutine, concurrently;
// calls may nest. It fails with hal.ErrClosed after Close.
//
// After a sticky error (illegal address, launch failure, ...; see stickyCode)
// seen by any call, Do fails at once with a *DeviceLostError naming that first
// failure, for every later call: nothing waits on a dead context.
func (d *device) Do(fn func() error) error {
	if d.closed.Load() {
		return fmt.Errorf("cuda: device %d: %w", d.info.Index, hal.ErrClosed)
	}
	if err := d.sticky.err(); err != nil {
		return err
	}
	return d.sticky.note(d.info.Index, d.run(fn))
}

// run is Do without the device-lost check: Close uses it to release what it
// can after a sticky error.
func (d *device) run(fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var cur uintptr
	if err := check(d.api, "cuCtxGetCurrent", d.api.ctxGetCurrent(&cur)); err != nil {
		return err
	}
	if cur != d.ctx {
		if err := check(d.api, "cuCtxSetCurrent", d.api.cuCtxSetCurrent(d.ctx)); err != nil {
			return err
		}
	}
	return fn()
}

// Info returns the device's static properties. It makes no driver call.
func (d *device) Info() hal.DeviceInfo { return d.info }

// PriorityRange returns the least (numerically greatest, usually 0) and the
// greatest (numerically least, e.g. -5) stream priority.
func (d *device) PriorityRange() (least, greatest int) { return d.leastPrio, d.greatestPrio }

// Alloc returns n bytes of device memory (cuMemAlloc_v2, 256-byte aligned).
// It does not wait for any stream.
func (d *device) Alloc(n int) (hal.Ptr, error) {
	if n <= 0 {
		return 0, fmt.Errorf("cuda: Alloc(%d): size must be positive", n)
	}
	var p uintptr
	err := d.Do(func() error { return check(d.api, "cuMemAlloc_v2", d.api.cuMemAlloc(&p, uintptr(n))) })
	if err != nil {
		return 0, fmt.Errorf("cuda: Alloc(%d bytes) on device %d: %w", n, d.info.Index, err)
	}
	d.mu.Lock()
	d.mem[hal.Ptr(p)] = n
	d.mu.Unlock()
	return hal.Ptr(p), nil
}

// Free releases memory from Alloc (cuMemFree_v2). The driver may wait for
// work using it to finish. p must come from Alloc on this device
// (hal.ErrBadPointer otherwise).
func (d *device) Free(p hal.Ptr) error {
	d.mu.Lock()
	_, ok := d.mem[p]
	delete(d.mem, p)
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("cuda: Free(%#x) on device %d: %w", uintptr(p), d.info.Index, hal.ErrBadPointer)
	}
	return d.Do(func() error { return check(d.api, "cuMemFree_v2", d.api.cuMemFree(uintptr(p))) })
}

// AllocHost returns n bytes of page-locked host memory (cuMemAllocHost_v2),
// usable by the async copies of every stream of this device.
func (d *device) AllocHost(n int) (unsafe.Pointer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("cuda: AllocHost(%d): size must be positive", n)
	}
	var p unsafe.Pointer
	err := d.Do(func() error { return check(d.api, "cuMemAllocHost_v2", d.api.cuMemAllocHost(&p, uintptr(n))) })
	if err != nil {
		return nil, fmt.Errorf("cuda: AllocHost(%d bytes): %w", n, err)
	}
	d.mu.Lock()
	d.host[p] = n
	d.mu.Unlock()
	return p, nil
}

// FreeHost releases memory from AllocHost (cuMemFreeHost). The caller must
// make sure no queued copy still uses it.
func (d *device) FreeHost(p unsafe.Pointer) error {
	d.mu.Lock()
	_, ok := d.host[p]
	delete(d.host, p)
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("cuda: FreeHost(%p): %w (not from AllocHost on device %d)", p, hal.ErrBadPointer, d.info.Index)
	}
	return d.Do(func() error { return check(d.api, "cuMemFreeHost", d.api.cuMemFreeHost(p)) })
}

func checkSize(call string, n int) error {
	if n < 0 {
		return fmt.Errorf("cuda: %s: negative size %d", call, n)
	}
	return nil
}

// CopyHtoD copies n bytes from host src to device dst and returns when the
// bytes are in device memory (cuMemcpyHtoD_v2, then cuStreamSynchronize of
// the legacy default stream). It is ordered after work on the legacy default
// stream only; synchronise other streams first.
//
// The synchronize is what makes it synchronous: from pageable memory,
// cuMemcpyHtoD returns once the bytes are staged, and the DMA to dst may still
// be pending on the legacy stream (CUDA driver API, "API synchronization
// behavior"). Every stream of this backend is CU_STREAM_NON_BLOCKING, so work
// queued on one after CopyHtoD returned would not wait for that DMA and could
// read dst's old contents: under load from another process it did (moe's
// TestLayerDualBitwise, bench/RESULTS.md 2026-12-02).
func (d *device) CopyHtoD(dst hal.Ptr, src unsafe.Pointer, n int) error {
	if err := checkSize("CopyHtoD", n); err != nil || n == 0 {
		return err
	}
	return d.Do(func() error {
		if err := check(d.api, "cuMemcpyHtoD_v2", d.api.cuMemcpyHtoD(uintptr(dst), src, uintptr(n))); err != nil {
			return err
		}
		return check(d.api, "cuStreamSynchronize", d.api.cuStreamSynchronize(legacyStream))
	})
}

// legacyStream is the handle of the legacy default stream (CU_STREAM_LEGACY
// is 0x1; the NULL stream is the legacy one in the driver API).
const legacyStream = 0

// CopyDtoH copies n bytes from device src to host dst and returns when done
// (cuMemcpyDtoH_v2). Ordering as for CopyHtoD.
func (d *device) CopyDtoH(dst unsafe.Pointer, src hal.Ptr, n int) error {
	if err := checkSize("CopyDtoH", n); err != nil || n == 0 {
		return err
	}
	return d.Do(func() error {
		return check(d.api, "cuMemcpyDtoH_v2", d.api.cuMemcpyDtoH(dst, uintptr(src), uintptr(n)))
	})
}

// CopyDtoD copies n bytes between device buffers and returns when they are
// copied (cuMemcpyDtoD_v2, which returns before the copy completes, then
// cuStreamSynchronize of the legacy default stream, as in CopyHtoD). Ordering
// as for CopyHtoD.
func (d *device) CopyDtoD(dst, src hal.Ptr, n int) error {
	if err := checkSize("CopyDtoD", n); err != nil || n == 0 {
		return err
	}
	return d.Do(func() error {
		if err := check(d.api, "cuMemcpyDtoD_v2", d.api.cuMemcpyDtoD(uintptr(dst), uintptr(src), uintptr(n))); err != nil {
			return err
		}
		return check(d.api, "cuStreamSynchronize", d.api.cuStreamSynchronize(legacyStream))
	})
}

// streamIDs numbers streams process-wide; IDs are never reused.
var streamIDs atomic.Uint64

// NewStream creates a stream (cuStreamCreateWithPriority). Priorities outside
// PriorityRange are clamped by the driver.
func (d *device) NewStream(o hal.StreamOptions) (hal.Stream, error) {
	var flags uint32
	if o.NonBlocking {
		flags |= cuStreamNonBlocking
	}
	s := &stream{d: d, id: streamIDs.Add(1)}
	err := d.Do(func() error {
		return check(d.api, "cuStreamCreateWithPriority", d.api.cuStreamCreateWithPriority(&s.h, flags, int32(o.Priority)))
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: NewStream(%+v): %w", o, err)
	}
	d.mu.Lock()
	d.streams[s] = struct{}{}
	d.mu.Unlock()
	return s, nil
}

// NewEvent creates an event (cuEventCreate); timing=false disables timing,
// which makes Record and Wait cheaper.
func (d *device) NewEvent(timing bool) (hal.Event, error) {
	flags := uint32(cuEventDisableTiming)
	if timing {
		flags = cuEventDefault
	}
	e := &event{d: d, timing: timing}
	err := d.Do(func() error { return check(d.api, "cuEventCreate", d.api.cuEventCreate(&e.h, flags)) })
	if err != nil {
		return nil, fmt.Errorf("cuda: NewEvent: %w", err)
	}
	d.mu.Lock()
	d.events[e] = struct{}{}
	d.mu.Unlock()
	return e, nil
}

// NewBlasHandle creates a cuBLAS handle through package cublas, loading cuBLAS
// on first use (the error then is the loader's diagnosis). The handle is
// destroyed at Close if the caller has not destroyed it.
func (d *device) NewBlasHandle() (hal.BlasHandle, error) {
	lib, err := d.b.blasLib()
	if err != nil {
		return nil, fmt.Errorf("cuda: NewBlasHandle on device %d: %w", d.info.Index, err)
	}
	h, err := lib.NewHandle(d, d.info.ComputeMajor, d.info.ComputeMinor)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.handles = append(d.handles, h)
	d.mu.Unlock()
	return h, nil
}

// NewLtHandle creates a cuBLASLt handle through package cublas, loading the
// libraries on first use. The handle is destroyed at Close if the caller has
// not destroyed it.
func (d *device) NewLtHandle() (hal.LtHandle, error) {
	lib, err := d.b.blasLib()
	if err != nil {
		return nil, fmt.Errorf("cuda: NewLtHandle on device %d: %w", d.info.Index, err)
	}
	h, err := lib.NewLtHandle(d)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.handles = append(d.handles, h)
	d.mu.Unlock()
	return h, nil
}

// Synchronize blocks until all work on every stream of the device is done
// (cuCtxSynchronize).
func (d *device) Synchronize() error {
	return d.Do(func() error { return check(d.api, "cuCtxSynchronize", d.api.cuCtxSynchronize()) })
}

// MemInfo reports free and total device memory (cuMemGetInfo_v2).
func (d *device) MemInfo() (free, total uint64, err error) {
	var f, t uintptr
	err = d.Do(func() error { return check(d.api, "cuMemGetInfo_v2", d.api.cuMemGetInfo(&f, &t)) })
	return uint64(f), uint64(t), err
}

// close releases everything the device made, then its primary context.
func (d *device) close() error {
	if d.closed.Load() {
		return nil
	}
	var errs []error
	d.mu.Lock()
	handles := d.handles
	d.handles = nil
	d.mu.Unlock()
	for _, h := range handles {
		if err := h.Destroy(); err != nil && !errors.Is(err, hal.ErrClosed) {
			errs = append(errs, err)
		}
	}
	err := d.run(func() error {
		d.modMu.Lock()
		for file, m := range d.modules {
			errs = append(errs, check(d.api, "cuModuleUnload", d.api.cuModuleUnload(m)))
			delete(d.modules, file)
		}
		d.kernels = map[string]*kernel{}
		d.modMu.Unlock()

		d.mu.Lock()
		defer d.mu.Unlock()
		for s := range d.streams {
			if s.destroyed.CompareAndSwap(false, true) {
				errs = append(errs, check(d.api, "cuStreamDestroy_v2", d.api.cuStreamDestroy(s.h)))
			}
		}
		for e := range d.events {
			if e.destroyed.CompareAndSwap(false, true) {
				errs = append(errs, check(d.api, "cuEventDestroy_v2", d.api.cuEventDestroy(e.h)))
			}
		}
		for p := range d.mem {
			errs = append(errs, check(d.api, "cuMemFree_v2", d.api.cuMemFree(uintptr(p))))
		}
		for p := range d.host {
			errs = append(errs, check(d.api, "cuMemFreeHost", d.api.cuMemFreeHost(p)))
		}
		d.streams, d.events, d.mem, d.host = map[*stream]struct{}{}, map[*event]struct{}{}, map[hal.Ptr]int{}, map[unsafe.Pointer]int{}
		return nil
	})
	errs = append(errs, err)
	d.closed.Store(true)
	errs = append(errs, check(d.api, "cuDevicePrimaryCtxRelease_v2", d.api.cuDevicePrimaryCtxRelease(d.dev)))
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cuda: closing device %d: %w", d.info.Index, err)
	}
	return nil
}
