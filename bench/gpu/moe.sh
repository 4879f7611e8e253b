#!/usr/bin/env bash
# GPU run for the MoE issue, in one device call: the MoE (and root) tests on
# CUDA, `gpuctx moe bench` for DeepSeek-V2-Lite and Qwen1.5-MoE, and the PyTorch
# peer (bench/peers/torch_moe.py) timed in the same run.
# Build here first:  bash bench/gpu/pack.sh . ./moe/...
# Then on the GPU machine (carry .gpu):  bash bench/gpu/moe.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
RUN=${RUN:-.} bash .gpu/run.sh > "$OUT/tests-summary.txt" 2>&1; tail -4 "$OUT/tests-summary.txt"
grep -E '^--- FAIL|cuda' "$OUT/gpu-tests.log" | grep -E 'FAIL|PASS: .*cuda' | head -20
TOK=${TOK:-1,8,64,256,1024,4096}
.gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens "$TOK" --mode single,dual --dtype bf16 \
  --out "$OUT/moe-deepseek-v2-lite.md" --plot "$OUT/moe-deepseek-v2-lite.png" > "$OUT/bench.log" 2>&1
.gpu/gpuctx moe bench --preset qwen1.5-moe --tokens "$TOK" --mode single,dual --dtype bf16 \
  --out "$OUT/moe-qwen1.5-moe.md" >> "$OUT/bench.log" 2>&1
python3 bench/peers/torch_moe.py --preset deepseek-v2-lite --tokens "$TOK" > "$OUT/torch_moe.json" 2>> "$OUT/bench.log"
cat "$OUT/moe-deepseek-v2-lite.md"; tail -3 "$OUT/bench.log"
python3 - "$OUT/torch_moe.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("torch_moe.json unreadable:", e); sys.exit(0)
print(json.dumps(d)[:1200])
PY
# GEMM ratio check (bf16 8192^3): the same measurement as the peer (single-call
# timings) and back-to-back rounds, with the peer before and after.
{
  python3 bench/peers/torch_gemm.py --iters 30 | tr -d '\n'; echo
  .gpu/gpuctx gemm --m 8192 --n 8192 --k 8192 --dtype bf16 --iters 1 --repeats 50 --warmup 10 --json | tr -d '\n'; echo
  .gpu/gpuctx gemm --m 8192 --n 8192 --k 8192 --dtype bf16 --iters 1 --repeats 50 --warmup 10 --lt --json | tr -d '\n'; echo
  .gpu/gpuctx gemm --m 8192 --n 8192 --k 8192 --dtype bf16 --iters 20 --repeats 7 --json | tr -d '\n'; echo
  python3 bench/peers/torch_gemm.py --iters 30 | tr -d '\n'; echo
} > "$OUT/gemm2.jsonl" 2>> "$OUT/bench.log"
python3 - "$OUT/gemm2.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    if not l.strip(): continue
    r = json.loads(l)
    if "backend" in r:
        print(f"gpuctx {r.get('path')} iters={r['iters_per_stream']}: {r['tflops_all']:.1f} TFLOP/s")
    else:
        print("torch:", [(x['dtype'], x['tf32'], round(x['tflops_median'],1)) for x in r['results']])
PY
