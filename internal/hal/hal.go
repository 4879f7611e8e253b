// Package hal is the hardware abstraction layer: the interface that every gpuctx
// backend (backend/cuda, backend/rocm, backend/cpu) implements.
//
// hal is internal. The public API lives in the root package gpuctx, which wraps
// these interfaces, adds validation, closed-object checks and the stream-safe BLAS
// Context. Backends do not validate shapes (the root package and package blas do);
// they do check every vendor status and turn it into an error naming the call.
//
// Concurrency: every method may be called from any goroutine. Backends make the
// right device context current on the calling OS thread themselves (CUDA), so
// callers never lock OS threads.
package hal

import (
	"errors"
	"time"
	"unsafe"
)

// Ptr is a device address. On the CPU backend it is the address of host memory
// that the backend keeps alive until Free.
type Ptr uintptr

// Dim3 is a launch grid or block shape.
type Dim3 struct{ X, Y, Z int }

// Library describes one vendor library a backend loaded.
type Library struct {
	Name    string // "driver", "cublas", "cublasLt", "nvrtc", "gonum"
	Path    string // file that was loaded, or "" for built-in
	Version string // human readable, e.g. "13.1.0"
}

// DeviceInfo holds a device's static properties.
type DeviceInfo struct {
	Index        int
	Name         string
	ComputeMajor int // CUDA compute capability; 0 on CPU
	ComputeMinor int
	SMCount      int    // streaming multiprocessors (CUDA) or logical CPUs (CPU)
	TotalMemory  uint64 // bytes
	L2Bytes      int
	// DriverVersion is the CUDA driver API version (e.g. 13000) or 0.
	DriverVersion int
}

// Backend is one loaded backend.
type Backend interface {
	// Name is "cuda", "rocm" or "cpu".
	Name() string
	// DeviceCount reports how many devices the backend sees.
	DeviceCount() int
	// Device opens device i (primary context on CUDA). Calling it twice for the
	// same index returns the same Device.
	Device(i int) (Device, error)
	// Libraries lists the libraries the backend loaded, with paths and versions.
	Libraries() []Library
	// Close releases the backend and every device it opened. Idempotent.
	Close() error
}

// StreamOptions configures a new stream.
type StreamOptions struct {
	// NonBlocking: the stream does not synchronise with the legacy default stream.
	NonBlocking bool
	// Priority: lower numbers are higher priority (CUDA convention); 0 is default.
	Priority int
}

// Device is one device (primary context on CUDA).
type Device interface {
	Info() DeviceInfo
	// PriorityRange returns the least and greatest stream priority (CUDA: 0, -5).
	PriorityRange() (least, greatest int)

	// Alloc returns n bytes of device memory, 256-byte aligned. n > 0.
	Alloc(n int) (Ptr, error)
	// Free releases memory from Alloc.
	Free(p Ptr) error
	// AllocHost returns n bytes of page-locked host memory usable for async copies.
	AllocHost(n int) (unsafe.Pointer, error)
	// FreeHost releases memory from AllocHost.
	FreeHost(p unsafe.Pointer) error

	// CopyHtoD, CopyDtoH and CopyDtoD copy synchronously: they return once the
	// copy is complete. They are ordered after work already queued on the legacy
	// default stream only (like cuMemcpy); callers synchronise streams first.
	CopyHtoD(dst Ptr, src unsafe.Pointer, n int) error
	CopyDtoH(dst unsafe.Pointer, src Ptr, n int) error
	CopyDtoD(dst, src Ptr, n int) error

	NewStream(o StreamOptions) (Stream, error)
	// NewEvent makes an event; timing enables Elapsed.
	NewEvent(timing bool) (Event, error)

	// Kernel returns the named kernel (see package kernels for the names and
	// their arguments). On CUDA the source is compiled by NVRTC on first use for
	// this device's compute capability and cached for the life of the process.
	Kernel(name string) (Kernel, error)

	// NewBlasHandle creates a BLAS library handle (cublasCreate on CUDA).
	NewBlasHandle() (BlasHandle, error)
	// NewLtHandle creates a cuBLASLt-style handle (cublasLtCreate on CUDA).
	NewLtHandle() (LtHandle, error)

	// Synchronize waits for all work on the device.
	Synchronize() error
	// MemInfo reports free and total device memory in bytes.
	MemInfo() (free, total uint64, err error)
}

// Stream is an ordered queue of device work. Work on one stream runs in issue
// order; different streams may run concurrently.
type Stream interface {
	// Async copies are queued on the stream. Host pointers must come from
	// AllocHost (or, on the CPU backend, any memory the caller keeps alive and
	// untouched until the stream has passed the copy).
	CopyHtoDAsync(dst Ptr, src unsafe.Pointer, n int) error
	CopyDtoHAsync(dst unsafe.Pointer, src Ptr, n int) error
	CopyDtoDAsync(dst, src Ptr, n int) error
	MemsetAsync(dst Ptr, value byte, n int) error

	// Launch queues kernel k. args are the kernel's parameters in order; each is
	// one of Ptr, int32, uint32, int64, uint64, float32, float64.
	Launch(k Kernel, grid, block Dim3, sharedMem int, args ...any) error

	// Wait makes later work on this stream wait until e completes. It does not
	// block the host.
	Wait(e Event) error
	// Synchronize blocks the host until all work queued so far is done.
	Synchronize() error
	// Query reports whether all queued work is done.
	Query() (bool, error)
	// Destroy releases the stream after its queued work completes.
	Destroy() error
	// ID is unique per stream within the process (never reused).
	ID() uint64
}

// EarlyLauncher is implemented by streams that can start a kernel before the
// kernel queued ahead of it has finished (CUDA programmatic dependent launch).
// The kernel must wait (griddepcontrol.wait) before it touches memory that
// earlier work writes, or writes memory that earlier work reads. A stream that
// does not implement it, or cannot on its device, launches normally.
type EarlyLauncher interface {
	LaunchEarly(k Kernel, grid, block Dim3, sharedMem int, args ...any) error
}

// Event marks a point in a stream.
type Event interface {
	// Record captures the work queued on s so far.
	Record(s Stream) error
	// Synchronize blocks the host until the recorded work is done. An event never
	// recorded is complete.
	Synchronize() error
	Query() (bool, error)
	// Elapsed returns the time between start (recorded earlier) and this event;
	// both must have been made with timing and have completed.
	Elapsed(start Event) (time.Duration, error)
	Destroy() error
}

// Kernel is a compiled kernel on one device.
type Kernel interface {
	Name() string
}

// MathMode selects the BLAS math mode of a handle.
type MathMode int

const (
	// MathDefault is pedantic-free default math (CUBLAS_DEFAULT_MATH).
	MathDefault MathMode = iota
	// MathTensorOp allows tensor cores for reduced-precision inputs
	// (CUBLAS_DEFAULT_MATH on CUDA >= 11 already does; kept explicit).
	MathTensorOp
	// MathTF32 allows TF32 tensor-core math for f32 GEMMs (CUBLAS_TF32_TENSOR_OP_MATH).
	MathTF32
)

// DType is an element type.
type DType int

const (
	F32 DType = iota + 1
	F64
	F16
	BF16
	C64  // complex64
	C128 // complex128
	I32
	I64
	U8
)

// Size is the element size in bytes.
func (d DType) Size() int {
	switch d {
	case F32, I32:
		return 4
	case F64, C64, I64:
		return 8
	case F16, BF16:
		return 2
	case C128:
		return 16
	case U8:
		return 1
	}
	return 0
}

// String returns the short name used in errors and on the command line (f32, bf16, ...).
func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case F64:
		return "f64"
	case F16:
		return "f16"
	case BF16:
		return "bf16"
	case C64:
		return "c64"
	case C128:
		return "c128"
	case I32:
		return "i32"
	case I64:
		return "i64"
	case U8:
		return "u8"
	}
	return "invalid"
}

// Op is a transpose flag in column-major BLAS convention.
type Op int

const (
	NoTrans Op = iota
	Trans
)

// GemmDesc is one column-major GEMM: C = alpha*op(A)*op(B) + beta*C, with C m×n,
// op(A) m×k, op(B) k×n. A and B have dtype AB, C has dtype C. Compute is f32 for
// f16/bf16/f32 inputs (TF32 if the handle's math mode allows), f64 for f64.
// The root package validated every field before the backend sees it.
type GemmDesc struct {
	TransA, TransB Op
	M, N, K        int
	Alpha, Beta    float64
	A              Ptr
	LDA            int
	B              Ptr
	LDB            int
	C              Ptr
	LDC            int
	AB, CType      DType
}

// StridedBatch describes a strided batched GEMM: Count GEMMs, matrix i at
// A + i*StrideA elements (and likewise B, C).
type StridedBatch struct {
	Count                     int
	StrideA, StrideB, StrideC int64 // in elements
}

// GeamDesc is column-major C = alpha*op(A) + beta*op(B), C m×n, for f32, f64,
// c64, c128. Alpha and Beta are complex; real dtypes use their real parts.
type GeamDesc struct {
	TransA, TransB Op
	M, N           int
	Alpha, Beta    complex128
	A              Ptr
	LDA            int
	B              Ptr
	LDB            int
	C              Ptr
	LDC            int
	Type           DType
}

// BlasHandle is a BLAS library handle. It is NOT safe for concurrent use: the
// root package's Context serialises access and binds it to a stream. Every
// operation is queued on the stream of the last SetStream.
type BlasHandle interface {
	// SetStream binds the handle to s (cublasSetStream_v2, rocblas_set_stream).
	// On CUDA it resets the handle's workspace to the library default: call
	// SetWorkspace right after. See StreamBinder for how a handle says so.
	SetStream(s Stream) error
	// SetWorkspace makes [p, p+n) the handle's workspace (cublasSetWorkspace_v2).
	SetWorkspace(p Ptr, n int) error
	SetMathMode(m MathMode) error

	Gemm(d GemmDesc) error
	GemmStridedBatched(d GemmDesc, b StridedBatch) error
	// GemmGrouped runs len(ds) independent GEMMs (each its own shape) on the
	// bound stream: cublasGemmGroupedBatchedEx where available, otherwise one
	// GemmEx per group. All descs share AB, CType, Alpha and Beta.
	GemmGrouped(ds []GemmDesc) error
	Geam(d GeamDesc) error

	// GroupedNative reports whether GemmGrouped uses the library's grouped call.
	GroupedNative() bool
	Destroy() error
}

// StreamBinder is implemented by BLAS handles that say how their library
// treats a handle moving between streams; the root package's bind consults it
// so that callers never see the vendor difference. A handle that does not
// implement it is treated as cuBLAS: the workspace is lost on SetStream and
// the old stream need not be idle.
type StreamBinder interface {
	// SetStreamKeepsWorkspace reports whether SetStream leaves the handle's
	// workspace in place (rocblas_set_stream). False (cublasSetStream_v2):
	// SetStream resets it to the library default and SetWorkspace must be
	// called again after every SetStream.
	SetStreamKeepsWorkspace() bool
	// NeedsOldStreamIdle reports whether, when the handle holds a user-owned
	// workspace, the work it queued on its old stream must be finished, or
	// ordered before the new stream's work (an event recorded on the old stream
	// that the new stream waits on), before SetStream moves it (rocBLAS:
	// "synchronize the old stream before setting the new stream").
	NeedsOldStreamIdle() bool
}

// LtHandle is a cuBLASLt handle. Unlike BlasHandle it is not bound to a stream:
// the stream and the workspace are passed to every call. Not safe for concurrent
// use; the root package serialises access.
type LtHandle interface {
	// Matmul queues the GEMM d on s, using [ws, ws+wsSize) as workspace, with the
	// fastest algorithm the library's heuristic offers for that workspace size.
	// Supports AB in {F32, F16, BF16} with CType equal to AB or F32, f32 compute.
	Matmul(s Stream, d GemmDesc, ws Ptr, wsSize int) error
	Destroy() error
}

// Runner is implemented by devices whose library calls must run on an OS thread
// with the device's context current (CUDA). Do locks the calling goroutine to its
// thread, makes the context current if it is not, runs fn, and unlocks.
type Runner interface {
	Do(fn func() error) error
}

// RawStream is implemented by backend streams that wrap a vendor stream handle
// (CUstream); Handle returns it.
type RawStream interface {
	Handle() uintptr
}

// WorkspaceChecker is implemented by backends that can detect a BLAS workspace
// being used by two streams at once (the CPU backend). Conflicts returns the
// number of overlapping uses seen since the device was opened.
type WorkspaceChecker interface {
	WorkspaceConflicts() int64
}

// BlasInspector is implemented by BLAS handles that can report what the
// library itself holds (the CPU backend): the stream the handle is bound to
// (nil: none) and its workspace ((0, 0): the library default). Tests use it to
// check the binding rule against the handle, not against the caller's records.
type BlasInspector interface {
	BoundStream() Stream
	BoundWorkspace() (p Ptr, n int)
}

// Capturer is implemented by streams that can record their work into a graph
// (CUDA stream capture) instead of running it. Between BeginCapture and
// EndCapture, work queued on the stream is recorded, not run; a stream that
// waits on an event recorded during the capture joins it, and must be joined back
// (the capturing stream waits on an event recorded on it) before EndCapture.
// Nothing may synchronise the host with a capturing stream.
type Capturer interface {
	BeginCapture() error
	// EndCapture stops capturing and returns the recorded work as an executable
	// graph.
	EndCapture() (Graph, error)
}

// Graph is recorded work that can be launched again and again.
type Graph interface {
	// Launch queues the whole graph on s: it starts after the work queued on s
	// so far and later work on s waits for all of it.
	Launch(s Stream) error
	Destroy() error
}

// The error conditions of gpuctx and its backends, defined once: every package
// wraps these (package gpuctx re-exports them), so errors.Is matches a
// condition whichever backend or layer reported it.
var (
	// ErrClosed: the object (runtime, backend, device, stream, event, context,
	// library handle) was closed or destroyed.
	ErrClosed = errors.New("use of closed object")
	// ErrFreed: the buffer was freed.
	ErrFreed = errors.New("use of freed buffer")
	// ErrWrongDevice: an object of one device was used with another device.
	ErrWrongDevice = errors.New("object belongs to another device")
	// ErrSize: a size, offset or length does not fit.
	ErrSize = errors.New("size mismatch")
	// ErrInvalid: a bad argument (shape, dtype, kernel argument, option).
	ErrInvalid = errors.New("invalid argument")
	// ErrHandleExpired: a BLAS handle was used after its callback returned.
	ErrHandleExpired = errors.New("BLAS handle used after its callback returned")
	// ErrUnavailable: the backend or library cannot be used on this machine.
	ErrUnavailable = errors.New("backend unavailable")
	// ErrNoKernel: no kernel source defines the name asked for.
	ErrNoKernel = errors.New("no such kernel")
	// ErrBadPointer: a pointer that was not allocated on this device.
	ErrBadPointer = errors.New("pointer not allocated on this device")
	// ErrOutOfMemory: the device cannot hold an allocation of that size.
	ErrOutOfMemory = errors.New("out of device memory")
	// ErrDeviceLost: an earlier asynchronous error left the device unusable.
	ErrDeviceLost = errors.New("device lost after a sticky error")
)
