#!/usr/bin/env bash
# GPU run for the foundation and BLAS-context issues, in one device call.
# Build here first:  bash bench/gpu/pack.sh . ./backend/cuda/...
# Then on the GPU machine (carry .gpu):  bash bench/gpu/foundation_blas.sh
# Writes to $OUT: gpu-tests.log (tests + go benchmarks), gemm.jsonl (gpuctx gemm
# and the PyTorch peer, same run), info.txt.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
.gpu/gpuctx info > "$OUT/info.txt" 2>&1; cat "$OUT/info.txt"
RUN=${RUN:-.} BENCH=${BENCH:-'OverheadVsBare|BindingOverhead/cuda|AlternatingStreams/cuda|Contention/cuda|LaunchEmpty|EventRecord|ContextCheck'} \
  EXTRA=${EXTRA:-'-test.benchtime=300ms'} bash .gpu/run.sh
{
  for args in "--m 8192 --n 8192 --k 8192 --dtype bf16" "--m 8192 --n 8192 --k 8192 --dtype bf16 --lt" \
      "--m 4096 --n 4096 --k 4096 --dtype f32" "--m 4096 --n 4096 --k 4096 --dtype f32 --lt" "--m 4096 --n 4096 --k 4096 --dtype tf32"; do
    .gpu/gpuctx gemm $args --iters 20 --repeats 7 --json | tr -d '\n'; echo
  done
  for s in 1 2 4 8; do
    .gpu/gpuctx gemm --m 256 --n 256 --k 256 --dtype f32 --streams $s --iters 200 --repeats 5 --json | tr -d '\n'; echo
  done
  python3 bench/peers/torch_gemm.py | tr -d '\n'; echo
} > "$OUT/gemm.jsonl" 2> "$OUT/gemm.err"
tail -5 "$OUT/gemm.err"
python3 - "$OUT/gemm.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
torch = [r for r in rows if "backend" not in r]
ours = [r for r in rows if "backend" in r]
for r in ours:
    print(f"gpuctx {r.get('path','blas'):6} {r['dtype']:5} {r['m']}^3 streams={r['streams']}: {r['tflops_all']:.1f} TFLOP/s all, per stream {[round(x,1) for x in r['tflops_per_stream']]}, check {r['max_rel_err_sampled']:.2g}")
print(json.dumps(torch)[:1500])
PY
