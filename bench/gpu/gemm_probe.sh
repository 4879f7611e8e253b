#!/usr/bin/env bash
# Probe for the bf16 8192^3 gap between gpuctx and torch.matmul: workspace size
# (which steers cuBLAS's heuristic), cuBLAS vs cuBLASLt, and PyTorch with its
# default and its cuBLASLt backend, interleaved in one device call. Also
# re-measures the BLAS callback overhead. Build: bash bench/gpu/pack.sh .
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd . && .gpu/root.test -test.run XXX -test.bench 'BindingOverhead/cuda|AlternatingStreams/cuda' -test.benchtime 300ms -test.count 3) > "$OUT/binding.txt" 2>&1
grep Benchmark "$OUT/binding.txt" | grep -v "^Benchmark[A-Za-z]*$"
torch_bf16() {
python3 - "$1" <<'PY'
import sys, torch, statistics
torch.backends.cuda.preferred_blas_library(sys.argv[1])
n=8192; g=torch.Generator(device="cuda").manual_seed(1)
a=torch.randn(n,n,device="cuda",generator=g).bfloat16(); b=torch.randn(n,n,device="cuda",generator=g).bfloat16(); c=torch.empty(n,n,device="cuda",dtype=torch.bfloat16)
for _ in range(10): torch.matmul(a,b,out=c)
torch.cuda.synchronize(); t=[]
for _ in range(30):
    s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
    s.record(); torch.matmul(a,b,out=c); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
print(f"torch {sys.argv[1]:8} bf16 8192^3: {2*n**3/statistics.median(t)/1e9:.1f} TFLOP/s")
PY
}
ours() { # $1 = workspace bytes, rest = gemm flags
  ws=$1; shift
  GPUCTX_BLAS_WORKSPACE=$ws .gpu/gpuctx gemm --m 8192 --n 8192 --k 8192 --dtype bf16 --iters 1 --repeats 30 --warmup 10 --check=false "$@" --json \
    | python3 -c "import json,sys; r=json.load(sys.stdin); print(f\"gpuctx {r['path']:6} ws={int(sys.argv[1])>>20:2d}MiB bf16 8192^3: {r['tflops_all']:.1f} TFLOP/s\")" "$ws"
}
for round in 1 2; do
  torch_bf16 cublas; torch_bf16 cublaslt
  for ws in 1048576 4194304 8388608 33554432; do ours $ws; done
  ours 33554432 --lt; ours 4194304 --lt
done 2>&1 | tee "$OUT/gemm_probe.txt"
