// Package cuda is the CUDA backend of gpuctx: it implements the hal interfaces
// with the CUDA driver API (libcuda.so.1), NVRTC (libnvrtc) and, through
// package cublas, cuBLAS and cuBLASLt. Every library is loaded at run time with
// purego, so the package builds with CGO_ENABLED=0 and a binary that imports it
// runs on machines without CUDA (Open then returns the loader's diagnosis).
//
// Threads: CUDA's current context is per OS thread and goroutines move between
// threads, so every driver call that needs a context runs inside Device.Do,
// which pins the goroutine to its thread and makes the device's primary context
// current when it is not. Callers never lock OS threads themselves. Every
// method of every type here is safe to call from any goroutine.
//
// The driver library and NVRTC, once loaded, stay loaded for the life of the
// process (unloading libcuda while its worker threads run is not safe); Close
// releases everything else: primary contexts, modules, streams, events,
// memory, BLAS handles and the cuBLAS libraries.
package cuda

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/gpuctx/gpuctx/backend/cuda/cublas"
	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// driver is the process-wide binding of libcuda, made once.
var driver struct {
	once    sync.Once
	api     *driverAPI
	lib     *dynload.Library
	version int32
	err     error
}

// loadDriver loads and binds libcuda and calls cuInit(0), once per process.
func loadDriver() (*driverAPI, error) {
	driver.once.Do(func() {
		lib, err := dynload.Open(driverSpec)
		if err != nil {
			driver.err = fmt.Errorf("cuda: %w: %w", hal.ErrUnavailable, err)
			return
		}
		api := &driverAPI{}
		if err := lib.Bind(api.symbols()); err != nil {
			lib.Close()
			driver.err = fmt.Errorf("cuda: %w: %w", hal.ErrUnavailable, err)
			return
		}
		if err := api.bindHot(lib); err != nil {
			lib.Close()
			driver.err = fmt.Errorf("cuda: %w: %w", hal.ErrUnavailable, err)
			return
		}
		if api.cuEventElapsedTimeV2 == nil && api.cuEventElapsedTime == nil {
			lib.Close()
			driver.err = fmt.Errorf("cuda: %s has neither cuEventElapsedTime_v2 nor cuEventElapsedTime; update the NVIDIA driver: %w", lib.Path(), hal.ErrUnavailable)
			return
		}
		if err := check(api, "cuInit", api.cuInit(0)); err != nil {
			lib.Close()
			driver.err = fmt.Errorf("cuda: %w: %w (is the NVIDIA kernel module loaded and the device visible? check nvidia-smi)", hal.ErrUnavailable, err)
			return
		}
		var v int32
		if err := check(api, "cuDriverGetVersion", api.cuDriverGetVersion(&v)); err != nil {
			lib.Close()
			driver.err = fmt.Errorf("cuda: %w", err)
			return
		}
		driver.api, driver.lib, driver.version = api, lib, v
	})
	return driver.api, driver.err
}

// backend implements hal.Backend.
type backend struct {
	api   *driverAPI
	count int

	mu      sync.Mutex // guards everything below
	devices map[int]*device
	blas    *cublas.Lib // loaded on first BLAS use
	closed  bool
}

// Open loads the CUDA driver, initialises it and counts the devices. It
// returns an error wrapping hal.ErrUnavailable, with the loader's diagnosis,
// when libcuda cannot be loaded or no CUDA device is visible. Open may be
// called more than once; each Backend must be closed. It is safe to call from
// any goroutine.
func Open() (hal.Backend, error) {
	api, err := loadDriver()
	if err != nil {
		return nil, err
	}
	var n int32
	if err := check(api, "cuDeviceGetCount", api.cuDeviceGetCount(&n)); err != nil {
		return nil, fmt.Errorf("cuda: %w", err)
	}
	if n == 0 {
		return nil, fmt.Errorf("cuda: no CUDA device visible (driver %s loaded from %s; check CUDA_VISIBLE_DEVICES and nvidia-smi): %w",
			versionString(int(driver.version)), driver.lib.Path(), hal.ErrUnavailable)
	}
	return &backend{api: api, count: int(n), devices: map[int]*device{}}, nil
}

// versionString turns a CUDA version number such as 13000 into "13.0".
func versionString(v int) string {
	return fmt.Sprintf("%d.%d", v/1000, v%1000/10)
}

// Name returns "cuda".
func (b *backend) Name() string { return "cuda" }

// DeviceCount returns the number of CUDA devices the driver sees.
func (b *backend) DeviceCount() int { return b.count }

// Device opens device i: it retains the device's primary context and reads the
// device's properties. Calling it again for the same i returns the same
// Device. It is safe to call concurrently.
func (b *backend) Device(i int) (hal.Device, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, fmt.Errorf("cuda: Device(%d): %w", i, hal.ErrClosed)
	}
	if i < 0 || i >= b.count {
		return nil, fmt.Errorf("cuda: Device(%d): index out of range; this machine has %d CUDA device(s), numbered from 0", i, b.count)
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

// blasLib loads cuBLAS on first use; later calls return the same Lib.
func (b *backend) blasLib() (*cublas.Lib, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, fmt.Errorf("cuda: loading cuBLAS: backend: %w", hal.ErrClosed)
	}
	if b.blas != nil {
		return b.blas, nil
	}
	l, err := cublas.Load()
	if err != nil {
		return nil, err
	}
	b.blas = l
	return l, nil
}

// Libraries lists the driver, NVRTC (once a kernel was compiled) and cuBLAS
// (once a BLAS handle was made), with paths and versions.
func (b *backend) Libraries() []hal.Library {
	libs := []hal.Library{{Name: "driver", Path: driver.lib.Path(), Version: versionString(int(driver.version))}}
	if nv := loadedNVRTC(); nv != nil {
		libs = append(libs, hal.Library{Name: "nvrtc", Path: nv.lib.Path(), Version: nv.version})
	}
	b.mu.Lock()
	blas := b.blas
	b.mu.Unlock()
	if blas != nil {
		libs = append(libs, blas.Libraries()...)
	}
	return libs
}

// Close releases every device opened through b (BLAS handles, modules,
// streams, events, memory, then the primary context) and the cuBLAS library.
// It waits for nothing queued: work still running on the device when its
// context is released is abandoned. Close is idempotent; every other method
// fails with hal.ErrClosed afterwards.
func (b *backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	devs := b.devices
	b.devices = nil
	blas := b.blas
	b.blas = nil
	b.mu.Unlock()

	var errs []error
	for _, d := range devs {
		errs = append(errs, d.close())
	}
	if blas != nil {
		errs = append(errs, blas.Close())
	}
	return errors.Join(errs...)
}

// joinNames formats a list for error messages.
func joinNames(s []string) string { return strings.Join(s, ", ") }
