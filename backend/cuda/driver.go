package cuda

import (
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/gpuctx/gpuctx/internal/dynload"
)

// driverAPI is the raw CUDA driver function table, bound by purego from
// libcuda.so.1. The Go signatures follow cuda.h (CUDA 12/13, 64-bit Linux):
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
	cuInit             func(flags uint32) int32
	cuDriverGetVersion func(version *int32) int32
	cuGetErrorName     func(r int32, s **byte) int32
	cuGetErrorString   func(r int32, s **byte) int32

	cuDeviceGetCount          func(count *int32) int32
	cuDeviceGet               func(dev *int32, ordinal int32) int32
	cuDeviceGetName           func(name *byte, n int32, dev int32) int32
	cuDeviceGetAttribute      func(v *int32, attr int32, dev int32) int32
	cuDeviceTotalMem          func(bytes *uintptr, dev int32) int32 // cuDeviceTotalMem_v2
	cuDevicePrimaryCtxRetain  func(ctx *uintptr, dev int32) int32
	cuDevicePrimaryCtxRelease func(dev int32) int32 // cuDevicePrimaryCtxRelease_v2

	cuCtxSetCurrent             func(ctx uintptr) int32
	cuCtxGetCurrent             func(ctx *uintptr) int32
	cuCtxSynchronize            func() int32
	cuCtxGetStreamPriorityRange func(least, greatest *int32) int32

	cuMemGetInfo    func(free, total *uintptr) int32         // cuMemGetInfo_v2
	cuMemAlloc      func(dptr *uintptr, n uintptr) int32     // cuMemAlloc_v2
	cuMemFree       func(dptr uintptr) int32                 // cuMemFree_v2
	cuMemAllocHost  func(p *unsafe.Pointer, n uintptr) int32 // cuMemAllocHost_v2
	cuMemFreeHost   func(p unsafe.Pointer) int32
	cuMemcpyHtoD    func(dst uintptr, src unsafe.Pointer, n uintptr) int32 // _v2
	cuMemcpyDtoH    func(dst unsafe.Pointer, src uintptr, n uintptr) int32 // _v2
	cuMemcpyDtoD    func(dst, src uintptr, n uintptr) int32                // _v2
	cuMemcpyHtoDAsy func(dst uintptr, src unsafe.Pointer, n uintptr, s uintptr) int32
	cuMemcpyDtoHAsy func(dst unsafe.Pointer, src uintptr, n uintptr, s uintptr) int32
	cuMemcpyDtoDAsy func(dst, src uintptr, n uintptr, s uintptr) int32
	cuMemsetD8Async func(dst uintptr, v uint8, n uintptr, s uintptr) int32

	cuStreamCreateWithPriority func(s *uintptr, flags uint32, priority int32) int32
	cuStreamDestroy            func(s uintptr) int32 // cuStreamDestroy_v2
	cuStreamWaitEvent          func(s uintptr, e uintptr, flags uint32) int32
	cuStreamQuery              func(s uintptr) int32
	cuStreamSynchronize        func(s uintptr) int32

	cuEventCreate        func(e *uintptr, flags uint32) int32
	cuEventRecord        func(e uintptr, s uintptr) int32
	cuEventQuery         func(e uintptr) int32
	cuEventSynchronize   func(e uintptr) int32
	cuEventDestroy       func(e uintptr) int32                       // cuEventDestroy_v2
	cuEventElapsedTimeV2 func(ms *float32, start, end uintptr) int32 // optional: CUDA >= 12.8
	cuEventElapsedTime   func(ms *float32, start, end uintptr) int32 // optional: removed from CUDA 13 headers

	// Stream capture and graphs (all present since CUDA 11.4; optional so that
	// the backend still loads where they are not).
	cuStreamBeginCapture        func(s uintptr, mode int32) int32 // cuStreamBeginCapture_v2
	cuStreamEndCapture          func(s uintptr, graph *uintptr) int32
	cuGraphInstantiateWithFlags func(exec *uintptr, graph uintptr, flags uint64) int32
	cuGraphLaunch               func(exec uintptr, s uintptr) int32
	cuGraphExecDestroy          func(exec uintptr) int32
	cuGraphDestroy              func(graph uintptr) int32

	cuModuleLoadData    func(mod *uintptr, image unsafe.Pointer) int32
	cuModuleGetFunction func(fn *uintptr, mod uintptr, name string) int32
	cuModuleUnload      func(mod uintptr) int32
	cuFuncSetAttribute  func(fn uintptr, attr int32, v int32) int32
	cuFuncGetParamInfo  func(fn uintptr, index uintptr, offset, size *uintptr) int32 // optional: CUDA >= 12.4

	// cuLaunchKernel(f, gridX, gridY, gridZ, blockX, blockY, blockZ,
	// sharedMemBytes, stream, kernelParams, extra).
	cuLaunchKernel func(f uintptr, gx, gy, gz, bx, by, bz, shared uint32, s uintptr, params unsafe.Pointer, extra unsafe.Pointer) int32

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

// symbols is the one table that maps C symbol names to the fields of a.
func (a *driverAPI) symbols() []dynload.Symbol {
	return []dynload.Symbol{
		{Name: "cuInit", Fn: &a.cuInit},
		{Name: "cuDriverGetVersion", Fn: &a.cuDriverGetVersion},
		{Name: "cuGetErrorName", Fn: &a.cuGetErrorName},
		{Name: "cuGetErrorString", Fn: &a.cuGetErrorString},

		{Name: "cuDeviceGetCount", Fn: &a.cuDeviceGetCount},
		{Name: "cuDeviceGet", Fn: &a.cuDeviceGet},
		{Name: "cuDeviceGetName", Fn: &a.cuDeviceGetName},
		{Name: "cuDeviceGetAttribute", Fn: &a.cuDeviceGetAttribute},
		{Name: "cuDeviceTotalMem_v2", Fn: &a.cuDeviceTotalMem},
		{Name: "cuDevicePrimaryCtxRetain", Fn: &a.cuDevicePrimaryCtxRetain},
		{Name: "cuDevicePrimaryCtxRelease_v2", Fn: &a.cuDevicePrimaryCtxRelease},

		{Name: "cuCtxSetCurrent", Fn: &a.cuCtxSetCurrent},
		{Name: "cuCtxGetCurrent", Fn: &a.cuCtxGetCurrent},
		{Name: "cuCtxSynchronize", Fn: &a.cuCtxSynchronize},
		{Name: "cuCtxGetStreamPriorityRange", Fn: &a.cuCtxGetStreamPriorityRange},

		{Name: "cuMemGetInfo_v2", Fn: &a.cuMemGetInfo},
		{Name: "cuMemAlloc_v2", Fn: &a.cuMemAlloc},
		{Name: "cuMemFree_v2", Fn: &a.cuMemFree},
		{Name: "cuMemAllocHost_v2", Fn: &a.cuMemAllocHost},
		{Name: "cuMemFreeHost", Fn: &a.cuMemFreeHost},
		{Name: "cuMemcpyHtoD_v2", Fn: &a.cuMemcpyHtoD},
		{Name: "cuMemcpyDtoH_v2", Fn: &a.cuMemcpyDtoH},
		{Name: "cuMemcpyDtoD_v2", Fn: &a.cuMemcpyDtoD},
		{Name: "cuMemcpyHtoDAsync_v2", Fn: &a.cuMemcpyHtoDAsy},
		{Name: "cuMemcpyDtoHAsync_v2", Fn: &a.cuMemcpyDtoHAsy},
		{Name: "cuMemcpyDtoDAsync_v2", Fn: &a.cuMemcpyDtoDAsy},
		{Name: "cuMemsetD8Async", Fn: &a.cuMemsetD8Async},

		{Name: "cuStreamCreateWithPriority", Fn: &a.cuStreamCreateWithPriority},
		{Name: "cuStreamDestroy_v2", Fn: &a.cuStreamDestroy},
		{Name: "cuStreamWaitEvent", Fn: &a.cuStreamWaitEvent},
		{Name: "cuStreamQuery", Fn: &a.cuStreamQuery},
		{Name: "cuStreamSynchronize", Fn: &a.cuStreamSynchronize},

		{Name: "cuEventCreate", Fn: &a.cuEventCreate},
		{Name: "cuEventRecord", Fn: &a.cuEventRecord},
		{Name: "cuEventQuery", Fn: &a.cuEventQuery},
		{Name: "cuEventSynchronize", Fn: &a.cuEventSynchronize},
		{Name: "cuEventDestroy_v2", Fn: &a.cuEventDestroy},
		{Name: "cuEventElapsedTime_v2", Fn: &a.cuEventElapsedTimeV2, Optional: true},
		{Name: "cuEventElapsedTime", Fn: &a.cuEventElapsedTime, Optional: true},

		{Name: "cuModuleLoadData", Fn: &a.cuModuleLoadData},
		{Name: "cuModuleGetFunction", Fn: &a.cuModuleGetFunction},
		{Name: "cuModuleUnload", Fn: &a.cuModuleUnload},
		{Name: "cuFuncGetParamInfo", Fn: &a.cuFuncGetParamInfo, Optional: true},
		{Name: "cuFuncSetAttribute", Fn: &a.cuFuncSetAttribute},
		{Name: "cuStreamBeginCapture_v2", Fn: &a.cuStreamBeginCapture, Optional: true},
		{Name: "cuStreamEndCapture", Fn: &a.cuStreamEndCapture, Optional: true},
		{Name: "cuGraphInstantiateWithFlags", Fn: &a.cuGraphInstantiateWithFlags, Optional: true},
		{Name: "cuGraphLaunch", Fn: &a.cuGraphLaunch, Optional: true},
		{Name: "cuGraphExecDestroy", Fn: &a.cuGraphExecDestroy, Optional: true},
		{Name: "cuGraphDestroy", Fn: &a.cuGraphDestroy, Optional: true},
		{Name: "cuLaunchKernel", Fn: &a.cuLaunchKernel},
	}
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
