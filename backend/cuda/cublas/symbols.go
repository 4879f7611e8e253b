package cublas

//go:generate go run ../../../internal/cmd/gensyms -spec cublas.spec -out symbols_gen.go -pkg cublas

// The raw function tables blasAPI (cuBLAS), ltAPI (cuBLASLt) and drvAPI (the
// CUDA driver calls of the grouped GEMM), their func fields and their symbol
// lists are generated from the C prototypes in cublas.spec by
// internal/cmd/gensyms into symbols_gen.go; add a function there and run go
// generate, never edit symbols_gen.go. Each field is bound by purego from the
// symbol of its (versioned) name; the Go signatures follow cublas_api.h,
// cublasLt.h and cuda.h of cuBLAS/CUDA 12/13 (64-bit Linux):
//
//	cublasStatus_t, CUresult          -> int32 return
//	int, enums (cublasOperation_t, cudaDataType, cublasComputeType_t, ...) -> int32
//	long long int, int64_t            -> int64
//	size_t, uint64_t                  -> uint64
//	handles, descriptors, streams (opaque pointers) -> uintptr
//	device pointers (void * in the headers) -> uintptr
//	host pointers                     -> unsafe.Pointer or *T
//	out-parameters, in-arrays (T x[]) -> *T of the matching Go type
//
// Optional symbols are nil when absent.

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
