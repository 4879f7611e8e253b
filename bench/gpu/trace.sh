#!/usr/bin/env bash
# Timeline and start-up checks on the GPU machine: the tracer, kernel-cache
# and moe run -v tests on CUDA, a one-shot moe run with a cold and then a warm
# kernel cache (-v breakdown), and traces of moe run, moe bench and gemm for
# ui.perfetto.dev. Build: bash bench/gpu/pack.sh . ./backend/cuda ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN='Tracer|TraceDual|KernelCache|VerboseAndTrace|BenchTrace' bash .gpu/run.sh > "$OUT/tests-summary.txt" 2>&1; tail -3 "$OUT/tests-summary.txt"
grep -E -- '--- (PASS|FAIL)' "$OUT/gpu-tests.log" | head -20
FIX=moe/testdata/deepseek_v2_greedy
export GPUCTX_KERNEL_CACHE="$OUT/kcache"; rm -rf "$GPUCTX_KERNEL_CACHE"
for run in cold warm; do
  echo "== moe run -v, $run kernel cache"
  .gpu/gpuctx moe run --model $FIX --input $FIX/input.safetensors --output "$OUT/y.safetensors" --dtype bf16 --mode dual -v 2>&1 >/dev/null
done
ls -la "$GPUCTX_KERNEL_CACHE"
echo "== moe run --trace"
.gpu/gpuctx moe run --model $FIX --input $FIX/input.safetensors --output "$OUT/y.safetensors" --dtype bf16 --mode dual --trace "$OUT/moe-run.json" -v
echo "== moe bench --trace"
.gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,64,1024 --mode single,dual --trace "$OUT/moe-bench.json" --out "$OUT/moe-bench.md" >/dev/null
sed -n '/^| tokens/,/^$/p' "$OUT/moe-bench.md"
echo "== gemm --trace"
.gpu/gpuctx gemm --m 4096 --n 4096 --k 4096 --dtype bf16 --streams 2 --trace "$OUT/gemm.json" | tail -3
python3 - "$OUT" <<'PY'
import json, sys, collections
for f in ("moe-run.json", "moe-bench.json", "gemm.json"):
    d = json.load(open(f"{sys.argv[1]}/{f}"))
    ev = d["traceEvents"]
    spans = [e for e in ev if e["ph"] == "X"]
    flows = collections.Counter((e["id"], e["ph"]) for e in ev if e["ph"] in "sf")
    top = collections.Counter()
    for e in spans:
        top[e["name"]] += e["dur"]
    print(f, len(spans), "spans on", len({e["tid"] for e in spans}), "tracks,", len(flows) // 2, "flows;",
          "busiest:", ", ".join(f"{n} {us:.0f} us" for n, us in top.most_common(6)))
PY
