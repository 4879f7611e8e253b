package rocm

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// hipAPI is the raw HIP runtime function table, bound by purego from
// libamdhip64.so. The Go signatures follow hip_runtime_api.h (ROCm 6, 64-bit
// Linux): hipError_t and enums -> int32, unsigned int -> uint32, size_t ->
// uintptr, device pointers and opaque handles (hipStream_t, hipEvent_t,
// hipModule_t, hipFunction_t, hipGraph_t, hipGraphExec_t) -> uintptr, host
// memory -> unsafe.Pointer. Tests fill the table with Go functions instead
// (fake_test.go), so that everything above it runs without a GPU.
type hipAPI struct {
	init                     func(flags uint32) int32
	driverGetVersion         func(v *int32) int32
	runtimeGetVersion        func(v *int32) int32
	getErrorName             func(e int32) string
	getErrorString           func(e int32) string
	getDeviceCount           func(n *int32) int32
	setDevice                func(dev int32) int32
	deviceGetName            func(name *byte, n int32, dev int32) int32
	deviceGetAttribute       func(v *int32, attr int32, dev int32) int32
	deviceTotalMem           func(bytes *uintptr, dev int32) int32
	deviceSynchronize        func() int32
	deviceGetStreamPriorityR func(least, greatest *int32) int32
	memGetInfo               func(free, total *uintptr) int32

	malloc     func(p *uintptr, n uintptr) int32
	free       func(p uintptr) int32
	hostMalloc func(p *unsafe.Pointer, n uintptr, flags uint32) int32
	hostFree   func(p unsafe.Pointer) int32

	memcpyHtoD      func(dst uintptr, src unsafe.Pointer, n uintptr) int32
	memcpyDtoH      func(dst unsafe.Pointer, src uintptr, n uintptr) int32
	memcpyDtoD      func(dst, src uintptr, n uintptr) int32
	memcpyHtoDAsync func(dst uintptr, src unsafe.Pointer, n uintptr, s uintptr) int32
	memcpyDtoHAsync func(dst unsafe.Pointer, src uintptr, n uintptr, s uintptr) int32
	memcpyDtoDAsync func(dst, src uintptr, n uintptr, s uintptr) int32
	memsetD8Async   func(dst uintptr, v uint8, n uintptr, s uintptr) int32

	streamCreateWithPriority func(s *uintptr, flags uint32, priority int32) int32
	streamDestroy            func(s uintptr) int32
	streamSynchronize        func(s uintptr) int32
	streamQuery              func(s uintptr) int32
	streamWaitEvent          func(s, e uintptr, flags uint32) int32

	eventCreateWithFlags func(e *uintptr, flags uint32) int32
	eventRecord          func(e, s uintptr) int32
	eventSynchronize     func(e uintptr) int32
	eventQuery           func(e uintptr) int32
	eventElapsedTime     func(ms *float32, start, end uintptr) int32
	eventDestroy         func(e uintptr) int32

	moduleLoadData     func(m *uintptr, image unsafe.Pointer) int32
	moduleGetFunction  func(f *uintptr, m uintptr, name *byte) int32
	moduleUnload       func(m uintptr) int32
	moduleLaunchKernel func(f uintptr, gx, gy, gz, bx, by, bz uint32, shared uint32, s uintptr, params, extra unsafe.Pointer) int32

	// Stream capture and graphs: optional, so that the backend loads where
	// a HIP build lacks them (Capture then reports hal.ErrUnavailable).
	streamBeginCapture func(s uintptr, mode int32) int32
	streamEndCapture   func(s uintptr, g *uintptr) int32
	graphInstantiate   func(exec *uintptr, g uintptr, errNode *uintptr, log *byte, logSize uintptr) int32
	graphLaunch        func(exec, s uintptr) int32
	graphExecDestroy   func(exec uintptr) int32
	graphDestroy       func(g uintptr) int32
}

func (a *hipAPI) symbols() []dynload.Symbol {
	return []dynload.Symbol{
		{Name: "hipInit", Fn: &a.init},
		{Name: "hipDriverGetVersion", Fn: &a.driverGetVersion},
		{Name: "hipRuntimeGetVersion", Fn: &a.runtimeGetVersion},
		{Name: "hipGetErrorName", Fn: &a.getErrorName},
		{Name: "hipGetErrorString", Fn: &a.getErrorString},
		{Name: "hipGetDeviceCount", Fn: &a.getDeviceCount},
		{Name: "hipSetDevice", Fn: &a.setDevice},
		{Name: "hipDeviceGetName", Fn: &a.deviceGetName},
		{Name: "hipDeviceGetAttribute", Fn: &a.deviceGetAttribute},
		{Name: "hipDeviceTotalMem", Fn: &a.deviceTotalMem},
		{Name: "hipDeviceSynchronize", Fn: &a.deviceSynchronize},
		{Name: "hipDeviceGetStreamPriorityRange", Fn: &a.deviceGetStreamPriorityR},
		{Name: "hipMemGetInfo", Fn: &a.memGetInfo},
		{Name: "hipMalloc", Fn: &a.malloc},
		{Name: "hipFree", Fn: &a.free},
		{Name: "hipHostMalloc", Fn: &a.hostMalloc},
		{Name: "hipHostFree", Fn: &a.hostFree},
		{Name: "hipMemcpyHtoD", Fn: &a.memcpyHtoD},
		{Name: "hipMemcpyDtoH", Fn: &a.memcpyDtoH},
		{Name: "hipMemcpyDtoD", Fn: &a.memcpyDtoD},
		{Name: "hipMemcpyHtoDAsync", Fn: &a.memcpyHtoDAsync},
		{Name: "hipMemcpyDtoHAsync", Fn: &a.memcpyDtoHAsync},
		{Name: "hipMemcpyDtoDAsync", Fn: &a.memcpyDtoDAsync},
		{Name: "hipMemsetD8Async", Fn: &a.memsetD8Async},
		{Name: "hipStreamCreateWithPriority", Fn: &a.streamCreateWithPriority},
		{Name: "hipStreamDestroy", Fn: &a.streamDestroy},
		{Name: "hipStreamSynchronize", Fn: &a.streamSynchronize},
		{Name: "hipStreamQuery", Fn: &a.streamQuery},
		{Name: "hipStreamWaitEvent", Fn: &a.streamWaitEvent},
		{Name: "hipEventCreateWithFlags", Fn: &a.eventCreateWithFlags},
		{Name: "hipEventRecord", Fn: &a.eventRecord},
		{Name: "hipEventSynchronize", Fn: &a.eventSynchronize},
		{Name: "hipEventQuery", Fn: &a.eventQuery},
		{Name: "hipEventElapsedTime", Fn: &a.eventElapsedTime},
		{Name: "hipEventDestroy", Fn: &a.eventDestroy},
		{Name: "hipModuleLoadData", Fn: &a.moduleLoadData},
		{Name: "hipModuleGetFunction", Fn: &a.moduleGetFunction},
		{Name: "hipModuleUnload", Fn: &a.moduleUnload},
		{Name: "hipModuleLaunchKernel", Fn: &a.moduleLaunchKernel},
		{Name: "hipStreamBeginCapture", Fn: &a.streamBeginCapture, Optional: true},
		{Name: "hipStreamEndCapture", Fn: &a.streamEndCapture, Optional: true},
		{Name: "hipGraphInstantiate", Fn: &a.graphInstantiate, Optional: true},
		{Name: "hipGraphLaunch", Fn: &a.graphLaunch, Optional: true},
		{Name: "hipGraphExecDestroy", Fn: &a.graphExecDestroy, Optional: true},
		{Name: "hipGraphDestroy", Fn: &a.graphDestroy, Optional: true},
	}
}

// rocblasAPI is the raw rocBLAS function table (rocblas.h, rocBLAS 4.x / ROCm
// 6): rocblas_handle and device pointers -> uintptr, rocblas_int and enums ->
// int32, rocblas_stride -> int64, size_t -> uintptr, host scalars ->
// unsafe.Pointer. rocBLAS has no grouped GEMM: GemmGrouped loops gemmEx.
type rocblasAPI struct {
	createHandle   func(h *uintptr) int32
	destroyHandle  func(h uintptr) int32
	setStream      func(h, s uintptr) int32
	setWorkspace   func(h, addr uintptr, size uintptr) int32
	setPointerMode func(h uintptr, mode int32) int32
	setMathMode    func(h uintptr, mode int32) int32 // optional (rocBLAS >= 3.1)
	statusToString func(s int32) string              // optional
	getVersion     func(buf *byte, n uintptr) int32  // optional

	// rocblas_gemm_ex(handle, transA, transB, m, n, k, alpha, a, a_type, lda,
	// b, b_type, ldb, beta, c, c_type, ldc, d, d_type, ldd, compute_type,
	// algo, solution_index, flags): 24 arguments; D = C here.
	gemmEx func(h uintptr, ta, tb, m, n, k int32,
		alpha unsafe.Pointer, a uintptr, at, lda int32,
		b uintptr, bt, ldb int32,
		beta unsafe.Pointer, c uintptr, ct, ldc int32,
		d uintptr, dt, ldd int32,
		compute, algo, solution int32, flags uint32) int32
	// rocblas_gemm_strided_batched_ex: 29 arguments (purego v0.11 allows 32).
	gemmStridedBatchedEx func(h uintptr, ta, tb, m, n, k int32,
		alpha unsafe.Pointer, a uintptr, at, lda int32, strideA int64,
		b uintptr, bt, ldb int32, strideB int64,
		beta unsafe.Pointer, c uintptr, ct, ldc int32, strideC int64,
		d uintptr, dt, ldd int32, strideD int64,
		batch, compute, algo, solution int32, flags uint32) int32

	sgeam, dgeam, cgeam, zgeam geamFn
}

// geamFn is rocblas_{s,d,c,z}geam: alpha and beta point to a host scalar of
// the element type (pointer mode host).
type geamFn func(h uintptr, ta, tb, m, n int32,
	alpha unsafe.Pointer, a uintptr, lda int32,
	beta unsafe.Pointer, b uintptr, ldb int32,
	c uintptr, ldc int32) int32

func (a *rocblasAPI) symbols() []dynload.Symbol {
	return []dynload.Symbol{
		{Name: "rocblas_create_handle", Fn: &a.createHandle},
		{Name: "rocblas_destroy_handle", Fn: &a.destroyHandle},
		{Name: "rocblas_set_stream", Fn: &a.setStream},
		{Name: "rocblas_set_workspace", Fn: &a.setWorkspace},
		{Name: "rocblas_set_pointer_mode", Fn: &a.setPointerMode},
		{Name: "rocblas_set_math_mode", Fn: &a.setMathMode, Optional: true},
		{Name: "rocblas_status_to_string", Fn: &a.statusToString, Optional: true},
		{Name: "rocblas_get_version_string", Fn: &a.getVersion, Optional: true},
		{Name: "rocblas_gemm_ex", Fn: &a.gemmEx},
		{Name: "rocblas_gemm_strided_batched_ex", Fn: &a.gemmStridedBatchedEx},
		{Name: "rocblas_sgeam", Fn: &a.sgeam},
		{Name: "rocblas_dgeam", Fn: &a.dgeam},
		{Name: "rocblas_cgeam", Fn: &a.cgeam},
		{Name: "rocblas_zgeam", Fn: &a.zgeam},
	}
}

// hiprtcAPI is the raw hipRTC table (hiprtc.h); hiprtcProgram -> uintptr.
type hiprtcAPI struct {
	version        func(major, minor *int32) int32
	getErrorString func(r int32) string
	createProgram  func(p *uintptr, src, name *byte, numHeaders int32, headers, includeNames **byte) int32
	compileProgram func(p uintptr, numOptions int32, options **byte) int32
	getCodeSize    func(p uintptr, n *uintptr) int32
	getCode        func(p uintptr, code *byte) int32
	getLogSize     func(p uintptr, n *uintptr) int32
	getLog         func(p uintptr, log *byte) int32
	destroyProgram func(p *uintptr) int32
}

func (a *hiprtcAPI) symbols() []dynload.Symbol {
	return []dynload.Symbol{
		{Name: "hiprtcVersion", Fn: &a.version},
		{Name: "hiprtcGetErrorString", Fn: &a.getErrorString},
		{Name: "hiprtcCreateProgram", Fn: &a.createProgram},
		{Name: "hiprtcCompileProgram", Fn: &a.compileProgram},
		{Name: "hiprtcGetCodeSize", Fn: &a.getCodeSize},
		{Name: "hiprtcGetCode", Fn: &a.getCode},
		{Name: "hiprtcGetProgramLogSize", Fn: &a.getLogSize},
		{Name: "hiprtcGetProgramLog", Fn: &a.getLog},
		{Name: "hiprtcDestroyProgram", Fn: &a.destroyProgram},
	}
}

// Where the libraries come from. ROCm installs under /opt/rocm/lib (with
// /opt/rocm-<version>/lib beside it); $GPUCTX_LIBRARY_PATH and the loader's
// own search (LD_LIBRARY_PATH, ld.so.cache) are tried first by dynload.
var (
	hipSpec = dynload.Spec{
		Name:    "HIP runtime",
		Sonames: []string{"libamdhip64.so.6", "libamdhip64.so.7", "libamdhip64.so"},
		Dirs:    rocmDirs(),
		Install: "ROCm (the HIP runtime, libamdhip64) and the amdgpu kernel driver; inside a container pass /dev/kfd and /dev/dri",
	}
	rocblasSpec = dynload.Spec{
		Name:    "rocBLAS",
		Sonames: []string{"librocblas.so.4", "librocblas.so.5", "librocblas.so"},
		Dirs:    rocmDirs(),
		Install: "ROCm's rocBLAS (e.g. apt install rocblas)",
	}
	hiprtcSpec = dynload.Spec{
		Name:    "hipRTC",
		Sonames: []string{"libhiprtc.so.6", "libhiprtc.so.7", "libhiprtc.so"},
		Dirs:    rocmDirs(),
		Install: "ROCm's HIP runtime compiler (libhiprtc, part of the HIP runtime packages)",
	}
)

// rocmDirs are $ROCM_PATH/lib and /opt/rocm/lib.
func rocmDirs() []string {
	dirs := []string{"/opt/rocm/lib"}
	if p := os.Getenv("ROCM_PATH"); p != "" {
		dirs = append([]string{filepath.Join(p, "lib")}, dirs...)
	}
	return dirs
}

// libs is the process-wide loaded HIP runtime; rocBLAS and hipRTC load on
// first use. The real loader binds them with dynload; tests install fake
// tables (loaders below are variables for that reason only).
type libs struct {
	hip     *hipAPI
	hipPath string
	version int32 // hipRuntimeGetVersion, e.g. 60241134

	blasOnce sync.Once
	blas     *rocblasAPI
	blasPath string
	blasErr  error

	rtcOnce sync.Once
	rtc     *hiprtcAPI
	rtcPath string
	rtcErr  error
}

var (
	loadHIP     = loadHIPReal
	loadRocblas = loadRocblasReal
	loadHIPRTC  = loadHIPRTCReal
)

func loadHIPReal() (*hipAPI, string, error) {
	lib, err := dynload.Open(hipSpec)
	if err != nil {
		return nil, "", err
	}
	a := &hipAPI{}
	if err := lib.Bind(a.symbols()); err != nil {
		lib.Close()
		return nil, "", err
	}
	return a, lib.Path(), nil // stays loaded for the life of the process
}

func loadRocblasReal() (*rocblasAPI, string, error) {
	lib, err := dynload.Open(rocblasSpec)
	if err != nil {
		return nil, "", err
	}
	a := &rocblasAPI{}
	if err := lib.Bind(a.symbols()); err != nil {
		lib.Close()
		return nil, "", err
	}
	return a, lib.Path(), nil
}

func loadHIPRTCReal() (*hiprtcAPI, string, error) {
	lib, err := dynload.Open(hiprtcSpec)
	if err != nil {
		return nil, "", err
	}
	a := &hiprtcAPI{}
	if err := lib.Bind(a.symbols()); err != nil {
		lib.Close()
		return nil, "", err
	}
	return a, lib.Path(), nil
}

// rocblasLib loads rocBLAS once.
func (l *libs) rocblasLib() (*rocblasAPI, error) {
	l.blasOnce.Do(func() {
		l.blas, l.blasPath, l.blasErr = loadRocblas()
		if l.blasErr != nil {
			l.blasErr = fmt.Errorf("rocm: %w: %w", hal.ErrUnavailable, l.blasErr)
		}
	})
	return l.blas, l.blasErr
}

// hiprtcLib loads hipRTC once.
func (l *libs) hiprtcLib() (*hiprtcAPI, error) {
	l.rtcOnce.Do(func() {
		l.rtc, l.rtcPath, l.rtcErr = loadHIPRTC()
		if l.rtcErr != nil {
			l.rtcErr = fmt.Errorf("rocm: %w: %w", hal.ErrUnavailable, l.rtcErr)
		}
	})
	return l.rtc, l.rtcErr
}
