package rocm

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// hipDeviceAttribute_t values (hip_runtime_api.h, ROCm 6).
const (
	attrL2CacheSize     = 19
	attrComputeMajor    = 23
	attrComputeMinor    = 61
	attrMultiprocessors = 63
	attrWarpSize        = 87

	hipStreamNonBlocking  = 0x1 // hipStreamNonBlocking
	hipEventDisableTiming = 0x2 // hipEventDisableTiming
	hipHostMallocDefault  = 0x0
)

// device implements hal.Device and hal.Runner for one HIP device.
type device struct {
	b    *backend
	api  *hipAPI
	idx  int32
	info hal.DeviceInfo
	warp int // wavefront size: 64 on CDNA (MI200, MI300), 32 on RDNA

	leastPrio, greatestPrio int

	mu      sync.Mutex
	modules map[string]*module // compiled kernel files by file name
	closed  bool
}

func openDevice(b *backend, i int) (*device, error) {
	d := &device{b: b, api: b.l.hip, idx: int32(i), modules: map[string]*module{}}
	err := d.Do(func() error {
		name := make([]byte, 256)
		if err := check(d.api, "hipDeviceGetName", d.api.deviceGetName(&name[0], int32(len(name)), d.idx)); err != nil {
			return err
		}
		attr := func(a int32) int {
			var v int32
			_ = d.api.deviceGetAttribute(&v, a, d.idx)
			return int(v)
		}
		var total uintptr
		if err := check(d.api, "hipDeviceTotalMem", d.api.deviceTotalMem(&total, d.idx)); err != nil {
			return err
		}
		var least, greatest int32
		if err := check(d.api, "hipDeviceGetStreamPriorityRange", d.api.deviceGetStreamPriorityR(&least, &greatest)); err != nil {
			return err
		}
		d.leastPrio, d.greatestPrio = int(least), int(greatest)
		d.warp = attr(attrWarpSize)
		d.info = hal.DeviceInfo{
			Index: i, Name: cString(name),
			ComputeMajor: attr(attrComputeMajor), ComputeMinor: attr(attrComputeMinor),
			SMCount: attr(attrMultiprocessors), TotalMemory: uint64(total), L2Bytes: attr(attrL2CacheSize),
			DriverVersion: int(b.l.version),
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("rocm: opening device %d: %w", i, err)
	}
	return d, nil
}

// Do runs fn on a locked OS thread with this device current (hipSetDevice
// is per thread in HIP, as CUDA's current context is).
func (d *device) Do(fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := check(d.api, "hipSetDevice", d.api.setDevice(d.idx)); err != nil {
		return err
	}
	return fn()
}

// run is Do after a closed check.
func (d *device) run(call string, fn func() error) error {
	d.mu.Lock()
	closed := d.closed
	d.mu.Unlock()
	if closed {
		return fmt.Errorf("rocm: %s: device %d: %w", call, d.idx, hal.ErrClosed)
	}
	if err := d.Do(fn); err != nil {
		return fmt.Errorf("rocm: %s: %w", call, err)
	}
	return nil
}

// Info returns the device's properties.
func (d *device) Info() hal.DeviceInfo { return d.info }

// PriorityRange returns hipDeviceGetStreamPriorityRange's least and greatest.
func (d *device) PriorityRange() (least, greatest int) { return d.leastPrio, d.greatestPrio }

func checkSize(call string, n int) error {
	if n <= 0 {
		return fmt.Errorf("rocm: %s: size %d; want > 0: %w", call, n, hal.ErrInvalid)
	}
	return nil
}

// Alloc returns n bytes of device memory (hipMalloc: 256-byte aligned).
func (d *device) Alloc(n int) (hal.Ptr, error) {
	if err := checkSize("Alloc", n); err != nil {
		return 0, err
	}
	var p uintptr
	err := d.run("Alloc", func() error { return check(d.api, "hipMalloc", d.api.malloc(&p, uintptr(n))) })
	return hal.Ptr(p), err
}

// Free releases memory from Alloc (hipFree, which waits for the device).
func (d *device) Free(p hal.Ptr) error {
	return d.run("Free", func() error { return check(d.api, "hipFree", d.api.free(uintptr(p))) })
}

// AllocHost returns n bytes of pinned host memory (hipHostMalloc).
func (d *device) AllocHost(n int) (unsafe.Pointer, error) {
	if err := checkSize("AllocHost", n); err != nil {
		return nil, err
	}
	var p unsafe.Pointer
	err := d.run("AllocHost", func() error {
		return check(d.api, "hipHostMalloc", d.api.hostMalloc(&p, uintptr(n), hipHostMallocDefault))
	})
	return p, err
}

// FreeHost releases memory from AllocHost.
func (d *device) FreeHost(p unsafe.Pointer) error {
	return d.run("FreeHost", func() error { return check(d.api, "hipHostFree", d.api.hostFree(p)) })
}

// CopyHtoD copies synchronously (hipMemcpyHtoD).
func (d *device) CopyHtoD(dst hal.Ptr, src unsafe.Pointer, n int) error {
	if err := checkSize("CopyHtoD", n); err != nil {
		return err
	}
	return d.run("CopyHtoD", func() error {
		return check(d.api, "hipMemcpyHtoD", d.api.memcpyHtoD(uintptr(dst), src, uintptr(n)))
	})
}

// CopyDtoH copies synchronously (hipMemcpyDtoH).
func (d *device) CopyDtoH(dst unsafe.Pointer, src hal.Ptr, n int) error {
	if err := checkSize("CopyDtoH", n); err != nil {
		return err
	}
	return d.run("CopyDtoH", func() error {
		return check(d.api, "hipMemcpyDtoH", d.api.memcpyDtoH(dst, uintptr(src), uintptr(n)))
	})
}

// CopyDtoD copies synchronously (hipMemcpyDtoD).
func (d *device) CopyDtoD(dst, src hal.Ptr, n int) error {
	if err := checkSize("CopyDtoD", n); err != nil {
		return err
	}
	return d.run("CopyDtoD", func() error {
		return check(d.api, "hipMemcpyDtoD", d.api.memcpyDtoD(uintptr(dst), uintptr(src), uintptr(n)))
	})
}

var streamIDs atomic.Uint64

// NewStream creates a HIP stream (hipStreamCreateWithPriority).
func (d *device) NewStream(o hal.StreamOptions) (hal.Stream, error) {
	var flags uint32
	if o.NonBlocking {
		flags = hipStreamNonBlocking
	}
	var h uintptr
	err := d.run("NewStream", func() error {
		return check(d.api, "hipStreamCreateWithPriority", d.api.streamCreateWithPriority(&h, flags, int32(o.Priority)))
	})
	if err != nil {
		return nil, err
	}
	return &stream{d: d, h: h, id: streamIDs.Add(1)}, nil
}

// NewEvent creates a HIP event (hipEventCreateWithFlags).
func (d *device) NewEvent(timing bool) (hal.Event, error) {
	var flags uint32
	if !timing {
		flags = hipEventDisableTiming
	}
	var h uintptr
	err := d.run("NewEvent", func() error {
		return check(d.api, "hipEventCreateWithFlags", d.api.eventCreateWithFlags(&h, flags))
	})
	if err != nil {
		return nil, err
	}
	return &event{d: d, h: h, timing: timing}, nil
}

// NewBlasHandle creates a rocBLAS handle (loading rocBLAS on first use).
func (d *device) NewBlasHandle() (hal.BlasHandle, error) {
	api, err := d.b.l.rocblasLib()
	if err != nil {
		return nil, err
	}
	return newHandle(d, api)
}

// NewLtHandle reports hal.ErrUnavailable: gpuctx has no hipBLASLt binding yet.
func (d *device) NewLtHandle() (hal.LtHandle, error) {
	return nil, fmt.Errorf("rocm: NewLtHandle: no hipBLASLt binding in this backend; use Blas: %w", hal.ErrUnavailable)
}

// Synchronize waits for all work on the device (hipDeviceSynchronize).
func (d *device) Synchronize() error {
	return d.run("Synchronize", func() error { return check(d.api, "hipDeviceSynchronize", d.api.deviceSynchronize()) })
}

// MemInfo reports free and total device memory (hipMemGetInfo).
func (d *device) MemInfo() (free, total uint64, err error) {
	var f, t uintptr
	err = d.run("MemInfo", func() error { return check(d.api, "hipMemGetInfo", d.api.memGetInfo(&f, &t)) })
	return uint64(f), uint64(t), err
}

func (d *device) close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	mods := d.modules
	d.modules = nil
	d.mu.Unlock()
	var errs []error
	_ = d.Do(func() error {
		for _, m := range mods {
			if m.h != 0 {
				errs = append(errs, check(d.api, "hipModuleUnload", d.api.moduleUnload(m.h)))
			}
		}
		return nil
	})
	d.mu.Lock()
	d.closed = true
	d.mu.Unlock()
	return errors.Join(errs...)
}
