// Package gpuctx is a pure-Go GPU runtime for inference work: devices, memory,
// streams, events and kernels on NVIDIA GPUs (CUDA driver API, cuBLAS, cuBLASLt
// and NVRTC, loaded at run time), on AMD GPUs (HIP, hipRTC and rocBLAS, loaded
// at run time; not yet run on AMD hardware) or on a CPU backend that keeps the
// same semantics, plus stream-safe BLAS Contexts whose library handles always
// run on the stream the caller chose.
//
// Open picks a backend: CUDA when libcuda loads and a device exists, else ROCm
// when libamdhip64 loads and a device exists, else the CPU backend.
// GPUCTX_BACKEND=cuda|rocm|cpu forces one; a forced backend that is not
// available is an error, never a silent fallback.
//
// # Streams and Contexts
//
// There is no default stream: every piece of work is queued on a Stream that
// the caller made (Device.NewStream) or on the stream of a Context. A Context
// made with ContextOptions.Stream nil creates a stream of its own; that is the
// stream to use when you have none in mind: Context.Stream returns it (queue
// kernels and copies there, then BLAS calls through Context.Blas run after
// them in order), and Context.Close closes it. StreamOptions.Blocking concerns
// only CUDA's legacy NULL stream, which gpuctx never uses.
//
// To drive several streams through one Context from several goroutines, give
// each goroutine a view: v, err := ctx.WithStream(s). A view shares the
// Context's handles, workspaces and lifetime and has its own current stream,
// so SetStream on one view never moves another. Never Close a view: closing a
// view closes the Context it came from, and every other view with it. Drop
// views when done (they hold nothing of their own) and Close only the Context
// itself, once, after every goroutine using a view has returned, as the
// example of Context.WithStream does.
//
// # Errors
//
// Every condition has one sentinel, defined once in internal/hal and
// re-exported here (ErrClosed, ErrInvalid, ErrSize, ErrOutOfMemory, ...); the
// backends wrap the same values, so errors.Is(err, gpuctx.ErrClosed) holds
// whichever backend or layer reported it. Messages have one shape,
//
//	<pkg>: <Op>: <what went wrong>: <cause>
//
// for example "gpuctx: Buffer.CopyToHost: 8 destination bytes for a 16-byte
// buffer: size mismatch": the package, the operation (Type.Method where there
// is one), the detail, and last the wrapped cause (%w): a sentinel or the
// lower layer's error, which has the same shape.
//
// Every method is safe for concurrent use by multiple goroutines unless its doc
// says otherwise. Callers never need runtime.LockOSThread: the CUDA backend makes
// the device's context current on whatever OS thread makes a driver call.
package gpuctx

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/gpuctx/gpuctx/backend/cpu"
	"github.com/gpuctx/gpuctx/backend/cuda"
	"github.com/gpuctx/gpuctx/backend/rocm"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// Errors returned (wrapped, with detail) by gpuctx. Test with errors.Is.
var (
	// ErrClosed: the object (runtime, device, stream, event, context) was closed.
	ErrClosed = hal.ErrClosed
	// ErrFreed: the buffer was freed.
	ErrFreed = hal.ErrFreed
	// ErrWrongDevice: an object of one device was used with another device.
	ErrWrongDevice = hal.ErrWrongDevice
	// ErrSize: a size, offset or length does not fit.
	ErrSize = hal.ErrSize
	// ErrInvalid: a bad argument (shape, dtype, kernel argument, option).
	ErrInvalid = hal.ErrInvalid
	// ErrHandleExpired: a BLAS handle was used after its callback returned.
	ErrHandleExpired = hal.ErrHandleExpired
	// ErrUnavailable: the backend or library cannot be used on this machine.
	ErrUnavailable = hal.ErrUnavailable
	// ErrNoKernel: Device.Kernel was asked for a name no kernel source defines.
	ErrNoKernel = hal.ErrNoKernel
	// ErrOutOfMemory: the device cannot hold an allocation of that size
	// (CUDA_ERROR_OUT_OF_MEMORY, or the CPU backend's memory budget).
	ErrOutOfMemory = hal.ErrOutOfMemory
	// ErrDeviceLost: an earlier asynchronous error (CUDA: illegal address,
	// launch failure, ...) left the device unusable; every later call on it
	// fails with an error naming that first failure. Close and reopen.
	ErrDeviceLost = hal.ErrDeviceLost
)

// DType is an element type.
type DType int

// Element types. The zero DType is no type: operations given it fail with
// ErrInvalid.
const (
	F32  DType = iota + 1 // float32
	F64                   // float64
	F16                   // IEEE half precision (package half)
	BF16                  // bfloat16 (package half)
	C64                   // complex64
	C128                  // complex128
	I32                   // int32
	I64                   // int64
	U8                    // uint8
)

// Size is the element size in bytes (0 for an unknown type).
func (t DType) Size() int { return hal.DType(t).Size() }

// String returns the short name used in errors and on the command line: "f32",
// "f64", "f16", "bf16", "c64", "c128", "i32", "i64" or "u8".
func (t DType) String() string { return hal.DType(t).String() }

// Dim3 is a kernel launch grid or block shape: X*Y*Z blocks, or threads per
// block.
type Dim3 struct{ X, Y, Z int }

// Library describes a vendor library a backend loaded.
type Library struct {
	Name    string // "driver", "cublas", "cublasLt", "nvrtc", "gonum"
	Path    string // file that was loaded, or "" for built-in
	Version string // human readable, e.g. "13.1.0"
}

// DeviceInfo holds a device's static properties.
type DeviceInfo struct {
	Index        int    // the device's index in its Runtime (Runtime.Device)
	Name         string // the vendor's device name, or the CPU model
	ComputeMajor int    // CUDA compute capability; 0 on CPU
	ComputeMinor int
	SMCount      int    // streaming multiprocessors (CUDA) or logical CPUs (CPU)
	TotalMemory  uint64 // bytes
	L2Bytes      int    // L2 cache size in bytes
	// DriverVersion is the CUDA driver API version (e.g. 13000) or 0.
	DriverVersion int
}

// Ptr is a device address: a Buffer's bytes as kernels and vendor libraries
// see them. Kernel launches accept it as an argument.
type Ptr uintptr

// Runtime is one opened backend and its devices.
type Runtime struct {
	be      hal.Backend
	mu      sync.Mutex
	devices map[int]*Device
	closed  bool
	note    string // why auto selection did not pick CUDA ("" otherwise)
}

// BackendEnv is the environment variable that forces a backend.
const BackendEnv = "GPUCTX_BACKEND"

// Open opens the backend named by $GPUCTX_BACKEND ("cuda", "rocm", "cpu", or
// "auto" when unset). Auto picks CUDA when libcuda loads and a device exists,
// else ROCm when libamdhip64 loads and a device exists, else CPU.
func Open() (*Runtime, error) {
	return OpenBackend(os.Getenv(BackendEnv))
}

// OpenBackend opens the named backend: "cuda", "rocm", "cpu", or "auto"/"" (see Open).
// A forced backend that is unavailable returns its diagnosis as the error.
func OpenBackend(name string) (*Runtime, error) {
	var be hal.Backend
	var err error
	var note string
	switch strings.ToLower(strings.TrimSpace(name)) {
	case "", "auto":
		if be, err = cuda.Open(); err != nil {
			cudaErr := err
			if be, err = rocm.Open(); err != nil {
				note = "auto selection fell back to the CPU backend because CUDA is unavailable: " + cudaErr.Error() +
					"\nand ROCm is unavailable: " + err.Error()
				be, err = cpu.Open()
			} else {
				note = "auto selection picked ROCm because CUDA is unavailable: " + cudaErr.Error()
			}
		}
	case "cuda":
		if be, err = cuda.Open(); err != nil {
			return nil, fmt.Errorf("gpuctx: backend cuda was requested but is unavailable: %w", err)
		}
	case "rocm":
		if be, err = rocm.Open(); err != nil {
			return nil, fmt.Errorf("gpuctx: backend rocm was requested but is unavailable: %w", err)
		}
	case "cpu":
		be, err = cpu.Open()
	default:
		return nil, fmt.Errorf("gpuctx: unknown backend %q (want cuda, rocm, cpu or auto): %w", name, ErrInvalid)
	}
	if err != nil {
		return nil, err
	}
	return &Runtime{be: be, devices: map[int]*Device{}, note: note}, nil
}

// SelectionNote says why automatic backend selection (Open with
// $GPUCTX_BACKEND unset, or OpenBackend("auto")) did not pick CUDA: the CUDA
// backend's error and, when it fell back to the CPU backend, the ROCm
// backend's, recorded when the Runtime was opened. It is "" when CUDA was
// picked or a backend was named explicitly.
func (r *Runtime) SelectionNote() string { return r.note }

// Backend returns "cuda", "rocm" or "cpu".
func (r *Runtime) Backend() string { return r.be.Name() }

// DeviceCount reports how many devices the backend sees.
func (r *Runtime) DeviceCount() int { return r.be.DeviceCount() }

// Libraries lists the vendor libraries loaded so far with their paths and versions.
func (r *Runtime) Libraries() []Library {
	libs := r.be.Libraries()
	out := make([]Library, len(libs))
	for i, l := range libs {
		out[i] = Library(l)
	}
	return out
}

// Device opens device i. Calling it again returns the same *Device.
func (r *Runtime) Device(i int) (*Device, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, fmt.Errorf("gpuctx: Runtime.Device: %w", ErrClosed)
	}
	if d, ok := r.devices[i]; ok {
		return d, nil
	}
	if i < 0 || i >= r.be.DeviceCount() {
		return nil, fmt.Errorf("gpuctx: device index %d out of range: the %s backend has %d device(s): %w", i, r.be.Name(), r.be.DeviceCount(), ErrInvalid)
	}
	hd, err := r.be.Device(i)
	if err != nil {
		return nil, err
	}
	d := newDevice(r, hd)
	r.devices[i] = d
	return d, nil
}

// Close closes every device opened through r (see Device.Close) and releases the
// backend. Double Close is harmless.
func (r *Runtime) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	devs := r.devices
	r.devices = nil
	r.mu.Unlock()
	var errs []error
	for _, d := range devs {
		errs = append(errs, d.Close())
	}
	errs = append(errs, r.be.Close())
	return errors.Join(errs...)
}
