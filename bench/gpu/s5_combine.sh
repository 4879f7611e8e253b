#!/usr/bin/env bash
# Session 5, sixth GPU call (commit 5e86494): the combine in the down kernel
# (gpuctx_moe_downc_<tile>), the plain top-k again, 16-row tiles up to 16
# tokens. Every CUDA test binary (TestCombineInDown compares it bytewise with
# the separate kernel), memcheck over it, then DeepSeek-V2-Lite at 1, 8, 64
# and Qwen3-30B-A3B at 1, 8 tokens against the Triton peer, each also with
# --separate-combine (A/B in the same call).
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
timeout 220 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -2 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -20
grep -E -c -- '--- PASS: TestCombineInDown/cuda' "$OUT/gpu-tests.log"
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run "TestCombineInDown/cuda/.*/(m16n16k128|m16n64k64)") > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:" /tmp/memcheck.log | head -12
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 120 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64 --mode dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
grep -E "^- note: fused tiles" "$OUT/moe-deepseek-v2-lite.md" | cut -c1-120
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64 --mode dual,fused,auto --small-batch -1 --separate-combine \
  --out /tmp/sep.md > /dev/null 2>> /tmp/bench.log
echo "== deepseek-v2-lite --separate-combine rc=$?"; row /tmp/sep.md
timeout 100 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> /tmp/bench.log
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
timeout 60 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8 --mode single --small-batch -1 --separate-combine \
  --out /tmp/sepq.md > /dev/null 2>> /tmp/bench.log
echo "== qwen3-30b-a3b --separate-combine rc=$?"; row /tmp/sepq.md
grep -E "^speed vs peer|^peer: [0-9]+ |rror" /tmp/bench.log | head
rm -f "$OUT/triton_moe_anchor.json"
echo "== total $(( $(date +%s) - t0 )) s"
