// Package rocm is the ROCm backend of gpuctx: it implements the hal interfaces
// with the HIP runtime (libamdhip64), hipRTC (libhiprtc) and rocBLAS
// (librocblas). Every library is loaded at run time with purego, so the
// package builds with CGO_ENABLED=0 and a binary that imports it runs on
// machines without ROCm (Open then returns the loader's diagnosis: every path
// tried).
//
// This backend has not run on AMD hardware. Its code paths (argument packing,
// status-to-error mapping, the stream binding rule) run in CI against fake
// HIP, hipRTC and rocBLAS function tables that execute on host memory
// (fake_test.go); what they model is documented there.
//
// Threads: HIP's current device is per OS thread, so every call runs inside
// device.Do, which pins the goroutine to its thread and calls hipSetDevice.
// Every method of every type here is safe to call from any goroutine.
//
// The binding rule differs from cuBLAS: rocblas_set_stream keeps the handle's
// workspace, and with a user-owned workspace the old stream's work must be
// finished before the handle moves. The BLAS handle says so through
// hal.StreamBinder; the root package's Context acts on it.
package rocm

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// loaded is the process-wide HIP runtime, loaded and initialised once.
var loaded struct {
	once sync.Once
	l    *libs
	err  error
}

// resetForTest forgets the loaded libraries (tests that swap the tables).
func resetForTest() {
	loaded.once = sync.Once{}
	loaded.l, loaded.err = nil, nil
}

func load() (*libs, error) {
	loaded.once.Do(func() {
		api, path, err := loadHIP()
		if err != nil {
			loaded.err = fmt.Errorf("rocm: %w: %w", hal.ErrUnavailable, err)
			return
		}
		if err := check(api, "hipInit", api.init(0)); err != nil {
			loaded.err = fmt.Errorf("rocm: %w: %w (is the amdgpu kernel driver loaded and /dev/kfd accessible? check rocminfo)", hal.ErrUnavailable, err)
			return
		}
		l := &libs{hip: api, hipPath: path}
		_ = api.runtimeGetVersion(&l.version)
		loaded.l = l
	})
	return loaded.l, loaded.err
}

// backend implements hal.Backend.
type backend struct {
	l     *libs
	count int

	mu      sync.Mutex
	devices map[int]*device
	closed  bool
}

// Open loads the HIP runtime, initialises it and counts the devices. It
// returns an error wrapping hal.ErrUnavailable, with the loader's diagnosis,
// when libamdhip64 cannot be loaded or no AMD GPU is visible. rocBLAS and
// hipRTC are loaded on first use. Safe to call from any goroutine; each
// Backend must be closed.
func Open() (hal.Backend, error) {
	l, err := load()
	if err != nil {
		return nil, err
	}
	var n int32
	if r := l.hip.getDeviceCount(&n); r != hipSuccess && r != hipErrorNoDevice {
		return nil, fmt.Errorf("rocm: %w", check(l.hip, "hipGetDeviceCount", r))
	}
	if n == 0 {
		return nil, fmt.Errorf("rocm: no AMD GPU visible (HIP runtime %s loaded from %s; check HIP_VISIBLE_DEVICES and rocminfo): %w",
			versionString(l.version), l.hipPath, hal.ErrUnavailable)
	}
	return &backend{l: l, count: int(n), devices: map[int]*device{}}, nil
}

// versionString turns a HIP version number (major*10000000 + minor*100000 +
// patch) into "6.2.41134".
func versionString(v int32) string {
	return fmt.Sprintf("%d.%d.%d", v/10000000, v/100000%100, v%100000)
}

// Name returns "rocm".
func (b *backend) Name() string { return "rocm" }

// DeviceCount returns the number of HIP devices.
func (b *backend) DeviceCount() int { return b.count }

// Device opens device i; the same index returns the same Device.
func (b *backend) Device(i int) (hal.Device, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, fmt.Errorf("rocm: Device(%d): %w", i, hal.ErrClosed)
	}
	if i < 0 || i >= b.count {
		return nil, fmt.Errorf("rocm: Device(%d): index out of range; this machine has %d HIP device(s), numbered from 0: %w", i, b.count, hal.ErrInvalid)
	}
	if d, ok := b.devices[i]; ok {
		return d, nil
	}
	d, err := openDevice(b, i)
	if err != nil {
		return nil, err
	}
	b.devices[i] = d
	return d, nil
}

// Libraries lists the HIP runtime, and hipRTC and rocBLAS once loaded.
func (b *backend) Libraries() []hal.Library {
	l := b.l
	out := []hal.Library{{Name: "hip", Path: l.hipPath, Version: versionString(l.version)}}
	if l.rtc != nil {
		var maj, min int32
		_ = l.rtc.version(&maj, &min)
		out = append(out, hal.Library{Name: "hiprtc", Path: l.rtcPath, Version: fmt.Sprintf("%d.%d", maj, min)})
	}
	if l.blas != nil {
		v := ""
		if l.blas.getVersion != nil {
			buf := make([]byte, 64)
			if l.blas.getVersion(&buf[0], uintptr(len(buf))) == 0 {
				v = cString(buf)
			}
		}
		out = append(out, hal.Library{Name: "rocblas", Path: l.blasPath, Version: v})
	}
	return out
}

// Close releases every device opened through b. Idempotent.
func (b *backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	devs := b.devices
	b.devices = nil
	b.mu.Unlock()
	var errs []error
	for _, d := range devs {
		errs = append(errs, d.close())
	}
	return errors.Join(errs...)
}

func cString(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}
