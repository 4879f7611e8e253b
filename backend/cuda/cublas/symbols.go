package cublas

import (
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/dynload"
)

// blasAPI is the raw cuBLAS function table. Each field is bound by purego from
// the symbol of the same (versioned) name; the Go signatures follow
// cublas_api.h of cuBLAS 12/13: handles, device pointers and streams are
// uintptr, C int and enums are int32, size_t is uint64, host pointers are
// unsafe.Pointer or *T. Optional symbols are nil when absent.
type blasAPI struct {
	create        func(h *uintptr) int32
	destroy       func(h uintptr) int32
	setStream     func(h uintptr, stream uintptr) int32
	getStream     func(h uintptr, stream *uintptr) int32
	setWorkspace  func(h uintptr, ws uintptr, size uint64) int32
	setMathMode   func(h uintptr, mode int32) int32
	setPointerMod func(h uintptr, mode int32) int32
	getVersion    func(h uintptr, v *int32) int32
	getProperty   func(typ int32, v *int32) int32 // optional
	statusName    func(s int32) string            // optional
	statusString  func(s int32) string            // optional

	gemmEx func(h uintptr, transa, transb, m, n, k int32,
		alpha unsafe.Pointer, a uintptr, atype, lda int32,
		b uintptr, btype, ldb int32,
		beta unsafe.Pointer, c uintptr, ctype, ldc int32,
		compute, algo int32) int32
	gemmStridedBatchedEx func(h uintptr, transa, transb, m, n, k int32,
		alpha unsafe.Pointer, a uintptr, atype, lda int32, strideA int64,
		b uintptr, btype, ldb int32, strideB int64,
		beta unsafe.Pointer, c uintptr, ctype, ldc int32, strideC int64,
		batch, compute, algo int32) int32
	// gemmGroupedBatchedEx is optional (cuBLAS >= 12.5). All int arrays,
	// alpha/beta arrays and trans arrays are host memory; a, b, c are device
	// arrays of device pointers.
	gemmGroupedBatchedEx func(h uintptr, transa, transb, m, n, k *int32,
		alpha unsafe.Pointer, a uintptr, atype int32, lda *int32,
		b uintptr, btype int32, ldb *int32,
		beta unsafe.Pointer, c uintptr, ctype int32, ldc *int32,
		groupCount int32, groupSize *int32, compute int32) int32

	sgeam geamFn
	dgeam geamFn
	cgeam geamFn
	zgeam geamFn
}

// geamFn is the shape of cublas{S,D,C,Z}geam; alpha and beta point to a host
// scalar of the matrix element type.
type geamFn func(h uintptr, transa, transb, m, n int32,
	alpha unsafe.Pointer, a uintptr, lda int32,
	beta unsafe.Pointer, b uintptr, ldb int32,
	c uintptr, ldc int32) int32

func (a *blasAPI) symbols() []dynload.Symbol {
	return []dynload.Symbol{
		{Name: "cublasCreate_v2", Fn: &a.create},
		{Name: "cublasDestroy_v2", Fn: &a.destroy},
		{Name: "cublasSetStream_v2", Fn: &a.setStream},
		{Name: "cublasGetStream_v2", Fn: &a.getStream},
		{Name: "cublasSetWorkspace_v2", Fn: &a.setWorkspace},
		{Name: "cublasSetMathMode", Fn: &a.setMathMode},
		{Name: "cublasSetPointerMode_v2", Fn: &a.setPointerMod},
		{Name: "cublasGetVersion_v2", Fn: &a.getVersion},
		{Name: "cublasGetProperty", Fn: &a.getProperty, Optional: true},
		{Name: "cublasGetStatusName", Fn: &a.statusName, Optional: true},
		{Name: "cublasGetStatusString", Fn: &a.statusString, Optional: true},
		{Name: "cublasGemmEx", Fn: &a.gemmEx},
		{Name: "cublasGemmStridedBatchedEx", Fn: &a.gemmStridedBatchedEx},
		{Name: "cublasGemmGroupedBatchedEx", Fn: &a.gemmGroupedBatchedEx, Optional: true},
		{Name: "cublasSgeam", Fn: &a.sgeam},
		{Name: "cublasDgeam", Fn: &a.dgeam},
		{Name: "cublasCgeam", Fn: &a.cgeam},
		{Name: "cublasZgeam", Fn: &a.zgeam},
	}
}

// ltHeuristicResult mirrors cublasLtMatmulHeuristicResult_t (96 bytes):
// cublasLtMatmulAlgo_t (uint64_t data[8]), size_t workspaceSize,
// cublasStatus_t state, float wavesCount, int reserved[4].
type ltHeuristicResult struct {
	algo [8]uint64
	_    uint64   // workspaceSize
	_    int32    // state
	_    float32  // wavesCount
	_    [4]int32 // reserved
}

// ltAPI is the raw cuBLASLt function table (cublasLt.h, cuBLAS 12/13).
type ltAPI struct {
	create           func(h *uintptr) int32
	destroy          func(h uintptr) int32
	getVersion       func() uint64
	descCreate       func(d *uintptr, compute, scaleType int32) int32
	descDestroy      func(d uintptr) int32
	descSetAttribute func(d uintptr, attr int32, buf unsafe.Pointer, size uint64) int32
	layoutCreate     func(l *uintptr, typ int32, rows, cols uint64, ld int64) int32
	layoutDestroy    func(l uintptr) int32
	prefCreate       func(p *uintptr) int32
	prefDestroy      func(p uintptr) int32
	prefSetAttribute func(p uintptr, attr int32, buf unsafe.Pointer, size uint64) int32
	algoGetHeuristic func(h, desc, a, b, c, d, pref uintptr, requested int32,
		results *ltHeuristicResult, returned *int32) int32
	matmul func(h, desc uintptr, alpha unsafe.Pointer, a, adesc, b, bdesc uintptr,
		beta unsafe.Pointer, c, cdesc, d, ddesc uintptr,
		algo *[8]uint64, ws uintptr, wsSize uint64, stream uintptr) int32
}

func (a *ltAPI) symbols() []dynload.Symbol {
	return []dynload.Symbol{
		{Name: "cublasLtCreate", Fn: &a.create},
		{Name: "cublasLtDestroy", Fn: &a.destroy},
		{Name: "cublasLtGetVersion", Fn: &a.getVersion},
		{Name: "cublasLtMatmulDescCreate", Fn: &a.descCreate},
		{Name: "cublasLtMatmulDescDestroy", Fn: &a.descDestroy},
		{Name: "cublasLtMatmulDescSetAttribute", Fn: &a.descSetAttribute},
		{Name: "cublasLtMatrixLayoutCreate", Fn: &a.layoutCreate},
		{Name: "cublasLtMatrixLayoutDestroy", Fn: &a.layoutDestroy},
		{Name: "cublasLtMatmulPreferenceCreate", Fn: &a.prefCreate},
		{Name: "cublasLtMatmulPreferenceDestroy", Fn: &a.prefDestroy},
		{Name: "cublasLtMatmulPreferenceSetAttribute", Fn: &a.prefSetAttribute},
		{Name: "cublasLtMatmulAlgoGetHeuristic", Fn: &a.algoGetHeuristic},
		{Name: "cublasLtMatmul", Fn: &a.matmul},
	}
}

// drvAPI is the handful of CUDA driver calls the native grouped GEMM needs to
// stage its device pointer arrays (see scratch).
type drvAPI struct {
	memAlloc       func(p *uintptr, size uint64) int32
	memFree        func(p uintptr) int32
	memAllocHost   func(p *unsafe.Pointer, size uint64) int32
	memFreeHost    func(p unsafe.Pointer) int32
	memcpyHtoDAsyn func(dst uintptr, src unsafe.Pointer, size uint64, stream uintptr) int32
	eventCreate    func(e *uintptr, flags uint32) int32
	eventRecord    func(e, stream uintptr) int32
	eventSync      func(e uintptr) int32
	eventDestroy   func(e uintptr) int32
	streamSync     func(stream uintptr) int32
	errorName      func(res int32, s **byte) int32 // optional
}

func (a *drvAPI) symbols() []dynload.Symbol {
	return []dynload.Symbol{
		{Name: "cuMemAlloc_v2", Fn: &a.memAlloc},
		{Name: "cuMemFree_v2", Fn: &a.memFree},
		{Name: "cuMemAllocHost_v2", Fn: &a.memAllocHost},
		{Name: "cuMemFreeHost", Fn: &a.memFreeHost},
		{Name: "cuMemcpyHtoDAsync_v2", Fn: &a.memcpyHtoDAsyn},
		{Name: "cuEventCreate", Fn: &a.eventCreate},
		{Name: "cuEventRecord", Fn: &a.eventRecord},
		{Name: "cuEventSynchronize", Fn: &a.eventSync},
		{Name: "cuEventDestroy_v2", Fn: &a.eventDestroy},
		{Name: "cuStreamSynchronize", Fn: &a.streamSync},
		{Name: "cuGetErrorName", Fn: &a.errorName, Optional: true},
	}
}
