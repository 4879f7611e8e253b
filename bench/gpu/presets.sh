#!/usr/bin/env bash
# Last run: the MoE and root tests on CUDA at the final commit, and the bench for
# the two presets not run before (deepseek-v3: 256 experts, ~22 GiB of bf16
# weights on the device and ~45 GiB of f32 random weights on the host; and
# qwen3-30b-a3b, which has no shared expert). Build: bash bench/gpu/pack.sh . ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN=${RUN:-.} bash .gpu/run.sh > "$OUT/tests-summary.txt" 2>&1; tail -3 "$OUT/tests-summary.txt"
grep -E -- '^--- (FAIL|SKIP)|^\s+--- FAIL' "$OUT/gpu-tests.log" | head
row() { sed -n '/^| tokens/,/^$/p' "$1"; }
.gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --mode single,dual,auto --out "$OUT/moe-qwen3-30b-a3b.md" >/dev/null 2>>"$OUT/bench.log"
echo "== qwen3-30b-a3b"; row "$OUT/moe-qwen3-30b-a3b.md"
timeout 420 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,8,64,256,1024 --mode single,dual,auto --iters 20 --out "$OUT/moe-deepseek-v3.md" >/dev/null 2>>"$OUT/bench.log"
echo "deepseek-v3 exit $?"; row "$OUT/moe-deepseek-v3.md"
tail -3 "$OUT/bench.log"
