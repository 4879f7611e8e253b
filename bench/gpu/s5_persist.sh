#!/usr/bin/env bash
# Session 5, second GPU call (commit 66cbd0c): the persistent warp-specialised
# warpgroup tiles (moe_wgp). Every CUDA test binary (TestLayerFusedTiles
# compares each new tile's bits with the CPU's), memcheck over one of them,
# DeepSeek-V2-Lite and Qwen3-30B-A3B at 1024 and 4096 tokens against the
# Triton peer (the tuner's per-tile times are in the .md notes), the kernels
# of one traced eager forward at 1 and 8 tokens, and ncu of the persistent
# kernels at 4096 tokens.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
timeout 200 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -30
grep -E -- '--- (PASS|FAIL).*g2s[46]p' "$OUT/gpu-tests.log" | head -12
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run "TestLayerFusedTiles/cuda/m128n128k64g2s4p") > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:|FAIL|ok" /tmp/memcheck.log | head -20
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$S" 2>&1
cat "$S"
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
grep -E "^- note: fused tiles: T=4096" "$OUT/moe-deepseek-v2-lite.md" | cut -c1-200
timeout 120 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> /tmp/bench.log
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
grep -E "^- note: fused tiles: T=4096" "$OUT/moe-qwen3-30b-a3b.md" | cut -c1-200
grep -E "^speed vs peer|^peer: [0-9]+ |rror" /tmp/bench.log | head
rm -f "$OUT/triton_moe_anchor.json"
for T in 1 8; do
  timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens $T --mode fused --small-batch -1 --trace /tmp/t$T.json --out /tmp/t$T.md > /dev/null 2>&1
  echo "== trace $T tokens rc=$?"; python3 bench/gpu/timeline.py /tmp/t$T.json 2>&1 | tail -8
done
timeout 100 ncu --clock-control none -k regex:'g2s4p' --launch-count 4 --section SpeedOfLight --section Occupancy --section WarpStateStats \
  .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 4096 --mode single --small-batch -1 --tile m128n128k64g2s4p --iters 1 --warmup 1 > /tmp/ncu4k.txt 2>&1
echo "ncu rc=$?"; grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Stall|Warp Cycles Per Issued" /tmp/ncu4k.txt | head -40
cp /tmp/ncu4k.txt "$OUT/ncu4k.txt"
echo "== total $(( $(date +%s) - t0 )) s"
