package cuda

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// kernel implements hal.Kernel: one CUfunction on one device.
type kernel struct {
	d    *device
	name string
	fn   uintptr // CUfunction
	// params are the byte sizes of the kernel's parameters from
	// cuFuncGetParamInfo, or nil when the driver lacks it (CUDA < 12.4).
	params []uintptr
	// dynShared is the dynamic shared memory this function has been opted in
	// to (cuFuncSetAttribute), beyond the default 48 KiB; raised on demand.
	dynShared   atomic.Int32
	dynSharedMu sync.Mutex // serialises raising it, so it never goes down
}

// Name returns the kernel's (unmangled) name.
func (k *kernel) Name() string { return k.name }

// maxKernelArgs bounds the arguments of one launch; the kernels in package
// kernels take far fewer.
const maxKernelArgs = 32

// paramBlock holds one launch's argument values and the array of pointers to
// them that cuLaunchKernel reads. It lives on the Go heap (which does not
// move) and is reused through a pool: the driver copies the values before
// cuLaunchKernel returns.
type paramBlock struct {
	vals [maxKernelArgs]uint64
	ptrs [maxKernelArgs]unsafe.Pointer
	// cfg and attr are cuLaunchKernelEx's arguments for an early launch.
	cfg  launchConfig
	attr launchAttribute
}

// launchConfig is CUlaunchConfig (cuda.h, 64-bit): 56 bytes.
type launchConfig struct {
	grid     [3]uint32
	block    [3]uint32
	shared   uint32
	_        uint32
	stream   uintptr
	attrs    *launchAttribute
	numAttrs uint32
	_        uint32
}

// launchAttribute is CUlaunchAttribute: an id, padding to 8 bytes, and a
// 64-byte value union.
type launchAttribute struct {
	id    uint32
	_     uint32
	value [64]byte
}

// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h).
const launchAttrProgrammaticStreamSerialization = 6

var paramPool = sync.Pool{New: func() any { return new(paramBlock) }}

// pack stores args into pb and returns each argument's size in bytes. A wrong
// type is an error naming the kernel and the argument index.
func pack(name string, pb *paramBlock, args []any) ([]uintptr, error) {
	if len(args) > maxKernelArgs {
		return nil, fmt.Errorf("cuda: Launch %s: %d arguments; at most %d are supported", name, len(args), maxKernelArgs)
	}
	var sizes [maxKernelArgs]uintptr
	for i, a := range args {
		slot := unsafe.Pointer(&pb.vals[i])
		pb.vals[i] = 0
		switch v := a.(type) {
		case hal.Ptr:
			*(*uint64)(slot) = uint64(v)
			sizes[i] = 8
		case int32:
			*(*int32)(slot) = v
			sizes[i] = 4
		case uint32:
			*(*uint32)(slot) = v
			sizes[i] = 4
		case int64:
			*(*int64)(slot) = v
			sizes[i] = 8
		case uint64:
			*(*uint64)(slot) = v
			sizes[i] = 8
		case float32:
			*(*float32)(slot) = v
			sizes[i] = 4
		case float64:
			*(*float64)(slot) = v
			sizes[i] = 8
		default:
			return nil, fmt.Errorf("cuda: Launch %s: argument %d has type %T; want one of hal.Ptr, int32, uint32, int64, uint64, float32, float64", name, i, a)
		}
		pb.ptrs[i] = slot
	}
	return sizes[:len(args)], nil
}

// checkParams compares the packed sizes with the kernel's declared parameters.
func checkParams(name string, want, got []uintptr) error {
	if want == nil {
		return nil
	}
	if len(want) != len(got) {
		return fmt.Errorf("cuda: Launch %s: %d arguments given, the kernel takes %d (see package kernels)", name, len(got), len(want))
	}
	for i := range want {
		if want[i] != got[i] {
			return fmt.Errorf("cuda: Launch %s: argument %d is %d bytes, the kernel's parameter %d is %d bytes (e.g. pass int64, not int32, for a long long)", name, i, got[i], i, want[i])
		}
	}
	return nil
}

// dim converts a launch dimension, which must be in [1, 2^31).
func dim(what string, v int) (uint32, error) {
	if v < 1 || v > math.MaxInt32 {
		return 0, fmt.Errorf("%s = %d; want 1..%d", what, v, math.MaxInt32)
	}
	return uint32(v), nil
}

// launch packs args and calls cuLaunchKernel on s; with early (and
// s.d.early) it calls cuLaunchKernelEx with programmatic stream
// serialisation instead, so that k may start before the kernel ahead of it on
// s has finished.
func (s *stream) launch(k *kernel, grid, block hal.Dim3, sharedMem int, args []any, early bool) error {
	var g, b [3]uint32
	var err error
	names := [6]string{"grid.X", "grid.Y", "grid.Z", "block.X", "block.Y", "block.Z"}
	for i, v := range [6]int{grid.X, grid.Y, grid.Z, block.X, block.Y, block.Z} {
		var u uint32
		if u, err = dim(names[i], v); err != nil {
			return fmt.Errorf("cuda: Launch %s: %w", k.name, err)
		}
		if i < 3 {
			g[i] = u
		} else {
			b[i-3] = u
		}
	}
	if sharedMem < 0 || sharedMem > math.MaxInt32 {
		return fmt.Errorf("cuda: Launch %s: sharedMem = %d; want 0..%d bytes", k.name, sharedMem, math.MaxInt32)
	}
	pb := paramPool.Get().(*paramBlock)
	defer paramPool.Put(pb)
	sizes, err := pack(k.name, pb, args)
	if err != nil {
		return err
	}
	if err := checkParams(k.name, k.params, sizes); err != nil {
		return err
	}
	var params unsafe.Pointer
	if len(args) > 0 {
		params = unsafe.Pointer(&pb.ptrs[0])
	}
	err = s.do("Launch", func() error {
		// Opt in before the first launch that asks for dynamic shared memory:
		// static plus dynamic beyond 48 KiB needs it, and the static part is
		// not known here.
		if sharedMem > 0 && int32(sharedMem) > k.dynShared.Load() {
			if err := k.raiseDynShared(int32(sharedMem)); err != nil {
				return err
			}
		}
		if early && s.d.early {
			pb.attr = launchAttribute{id: launchAttrProgrammaticStreamSerialization}
			pb.attr.value[0] = 1 // programmaticStreamSerializationAllowed (int)
			pb.cfg = launchConfig{grid: g, block: b, shared: uint32(sharedMem), stream: s.h, attrs: &pb.attr, numAttrs: 1}
			r := s.d.api.cuLaunchKernelEx(unsafe.Pointer(&pb.cfg), k.fn, params, nil)
			runtime.KeepAlive(pb)
			return check(s.d.api, "cuLaunchKernelEx", r)
		}
		r := s.d.api.launchKernel(k.fn, g, b, uint32(sharedMem), s.h, params)
		runtime.KeepAlive(pb)
		return check(s.d.api, "cuLaunchKernel", r)
	})
	if err != nil {
		return fmt.Errorf("cuda: Launch %s (grid %v, block %v): %w", k.name, grid, block, err)
	}
	return nil
}

// raiseDynShared opts k in to n bytes of dynamic shared memory (a block whose
// static and dynamic shared memory exceed 48 KiB needs it). Call inside Do.
func (k *kernel) raiseDynShared(n int32) error {
	k.dynSharedMu.Lock()
	defer k.dynSharedMu.Unlock()
	if n <= k.dynShared.Load() {
		return nil
	}
	r := k.d.api.cuFuncSetAttribute(k.fn, funcAttrMaxDynamicShared, n)
	if err := check(k.d.api, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", r); err != nil {
		return err
	}
	k.dynShared.Store(n)
	return nil
}

// paramSizes asks the driver for fn's parameter sizes (cuFuncGetParamInfo),
// or returns nil if the driver cannot tell. n is the parameter count the
// source declares: only those are asked for, so no call fails (a failing
// probe shows up as an API error under compute-sanitizer); n < 0 probes until
// the driver says there are no more. Call inside Do.
func (d *device) paramSizes(fn uintptr, n int) []uintptr {
	if d.api.cuFuncGetParamInfo == nil {
		return nil
	}
	limit := uintptr(maxKernelArgs + 1)
	if n >= 0 {
		limit = uintptr(n)
	}
	sizes := []uintptr{}
	for i := uintptr(0); i < limit; i++ {
		var off, size uintptr
		if d.api.cuFuncGetParamInfo(fn, i, &off, &size) != cudaSuccess {
			break // CUDA_ERROR_INVALID_VALUE past the last parameter
		}
		sizes = append(sizes, size)
	}
	return sizes
}
