package cuda

import (
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/gpuctx/gpuctx/internal/dynload"
)

//go:generate go run ../../internal/cmd/gensyms -spec driver.spec -out driver_syms.go -pkg cuda -type driverSyms

// driverAPI is the raw CUDA driver function table, bound by purego from
// libcuda.so.1. Its func fields (driverSyms) and their symbol list are
// generated from the C prototypes in driver.spec by internal/cmd/gensyms; add a
// function there and run go generate, never edit driver_syms.go. The Go
// signatures follow cuda.h (CUDA 12/13, 64-bit Linux):
//
//	CUresult                          -> int32 return
//	CUdevice, int, enums              -> int32
//	unsigned int                      -> uint32
//	size_t                            -> uintptr
//	CUdeviceptr (unsigned long long)  -> uintptr
//	CUcontext/CUstream/CUevent/CUmodule/CUfunction (opaque pointers) -> uintptr
//	out-parameters                    -> *T of the matching Go type
//	host memory (void*)               -> unsafe.Pointer
//
// Versioned names (_v2) are used wherever cuda.h #defines the plain name to
// them, because the plain names are the legacy ABI.
type driverAPI struct {
	driverSyms

	// hot holds the raw addresses of the calls on the per-launch path. They are
	// called with purego.SyscallN, which skips RegisterFunc's reflection
	// (about 150-250 ns per call); every argument is an integer or a pointer.
	hot struct {
		ctxGetCurrent, launchKernel, eventRecord, streamWaitEvent uintptr
	}
}

// bindHot fills a.hot from lib; the symbols were already bound, so they exist.
func (a *driverAPI) bindHot(lib *dynload.Library) error {
	for _, h := range []struct {
		name string
		addr *uintptr
	}{
		{"cuCtxGetCurrent", &a.hot.ctxGetCurrent},
		{"cuLaunchKernel", &a.hot.launchKernel},
		{"cuEventRecord", &a.hot.eventRecord},
		{"cuStreamWaitEvent", &a.hot.streamWaitEvent},
	} {
		addr, err := lib.Lookup(h.name)
		if err != nil {
			return err
		}
		*h.addr = addr
	}
	return nil
}

// ctxGetCurrent is cuCtxGetCurrent through SyscallN.
func (a *driverAPI) ctxGetCurrent(ctx *uintptr) int32 {
	r, _, _ := purego.SyscallN(a.hot.ctxGetCurrent, uintptr(unsafe.Pointer(ctx)))
	return int32(r)
}

// launchKernel is cuLaunchKernel through SyscallN (extra is always NULL).
func (a *driverAPI) launchKernel(f uintptr, g, b [3]uint32, shared uint32, s uintptr, params unsafe.Pointer) int32 {
	r, _, _ := purego.SyscallN(a.hot.launchKernel, f,
		uintptr(g[0]), uintptr(g[1]), uintptr(g[2]), uintptr(b[0]), uintptr(b[1]), uintptr(b[2]),
		uintptr(shared), s, uintptr(params), 0)
	return int32(r)
}

// eventRecord is cuEventRecord through SyscallN.
func (a *driverAPI) eventRecord(e, s uintptr) int32 {
	r, _, _ := purego.SyscallN(a.hot.eventRecord, e, s)
	return int32(r)
}

// streamWaitEvent is cuStreamWaitEvent through SyscallN.
func (a *driverAPI) streamWaitEvent(s, e uintptr, flags uint32) int32 {
	r, _, _ := purego.SyscallN(a.hot.streamWaitEvent, s, e, uintptr(flags))
	return int32(r)
}

// CUDA driver constants used here (cuda.h).
const (
	cuStreamNonBlocking   = 0x1 // CU_STREAM_NON_BLOCKING
	cuEventDefault        = 0x0 // CU_EVENT_DEFAULT
	cuEventDisableTiming  = 0x2 // CU_EVENT_DISABLE_TIMING
	attrMultiprocessors   = 16  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
	attrL2CacheSize       = 38  // CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
	attrComputeCapability = 75  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR (minor is 76)

	funcAttrMaxDynamicShared = 8 // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
)

// driverSpec says where libcuda comes from. The driver is installed with the
// kernel module, never by pip.
var driverSpec = dynload.Spec{
	Name:    "CUDA driver",
	Sonames: []string{"libcuda.so.1", "libcuda.so"},
	Install: "the NVIDIA driver (it ships libcuda.so.1; inside a container, run it with the NVIDIA container toolkit, e.g. docker run --gpus all)",
}
