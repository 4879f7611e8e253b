#!/usr/bin/env bash
# Session 4, final GPU run of the merged tree: every CUDA test binary,
# memcheck over the new kernels, moe run -v on a DeepSeek-V2-Lite-sized layer
# (cold, then warm kernel cache: issue 10), a dual-stream timeline, moe bench
# against the Triton peer for the three target presets in the same invocation,
# and ncu's per-kernel durations of one graph-replayed DeepSeek-V2-Lite forward
# at 8 tokens.
#   MEMCHECK=REGEXP  the moe tests memcheck runs (default: the session's new ones)
#   NORUN=1          leaves out moe run and the timeline (s4_final2.sh)
#   NONCU=1          leaves out ncu (s5_final.sh)
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
timeout 170 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -30
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run "${MEMCHECK:-TestRouteAlignOneLaunch|TestLoadLayer|TestLayerFusedTiles/cuda/m16n(32k256w1x2s3|64k256w1x4s3)}") > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:|FAIL" /tmp/memcheck.log | head -20
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
if [ -z "${NORUN:-}" ]; then
FIX=/tmp/dsv2
timeout 90 .gpu/gpuctx moe init --preset deepseek-v2-lite --dir $FIX > /dev/null 2>&1 || echo "moe init failed"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
TIMEFORMAT="wall %R s"
for run in "cold auto" "warm auto" "warm auto" "warm dual"; do
  set -- $run
  echo "== moe run -v --mode $2, $1 kernel cache"
  time timeout 60 .gpu/gpuctx moe run --model $FIX --input $FIX/input.safetensors --output /tmp/y.safetensors --dtype bf16 --mode $2 -v 2>&1 >/dev/null
done
echo "== after moe run: $(( $(date +%s) - t0 )) s"
fi
} > "$S" 2>&1
cat "$S"
if [ -z "${NORUN:-}" ]; then
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 64 --mode dual --trace /tmp/dual.json --out /tmp/dual.md > /dev/null 2>&1
python3 bench/gpu/timeline.py /tmp/dual.json "$OUT/timeline.png" > /tmp/timeline.txt 2>&1; echo "timeline rc=$?"; tail -12 /tmp/timeline.txt
fi
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" --plot "$OUT/moe-deepseek-v2-lite.png" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
timeout 120 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> /tmp/bench.log
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,64,1024 --mode single,dual,fused,auto --small-batch -1 --iters 20 $P \
  --out "$OUT/moe-deepseek-v3.md" > /dev/null 2>> /tmp/bench.log
echo "== deepseek-v3 rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v3.md"; grep -E "^speed vs peer|^peer: [0-9]+ " /tmp/bench.log
rm -f "$OUT/triton_moe_anchor.json"
[ -z "${NONCU:-}" ] && timeout 120 ncu --clock-control none --launch-count 40 --section SpeedOfLight \
  .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 8 --mode single --small-batch -1 --tile m16n16k128w1x1s4 --iters 3 --warmup 1 > /tmp/ncu8.txt 2>&1
[ -z "${NONCU:-}" ] && echo "ncu rc=$?" && grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput" /tmp/ncu8.txt | paste - - - | awk '{print $1, $(NF-4), $(NF-3), $NF}' | head -40
echo "== total $(( $(date +%s) - t0 )) s"
