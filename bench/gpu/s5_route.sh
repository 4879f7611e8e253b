#!/usr/bin/env bash
# Session 5, fourth GPU call (commit 97d8386 + the scratch phase test): the
# rank top-k, the small sort in route_align and the combine_rows grid. Every
# CUDA test binary; two sabotaged moe test binaries built from scratch copies
# (.gpu/moe_brk_sort.test: the small sort's ranks forced to 0;
# .gpu/moe_brk_rank.test: the rank selection's ties sent to the higher index),
# whose tests must FAIL; memcheck over the routing tests; the phases of
# route_align (moe/zz_ra_phases_test.go, git-excluded); DeepSeek-V2-Lite at
# 1, 8, 64 tokens and Qwen3-30B-A3B at 1, 8 tokens against the Triton peer.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
timeout 200 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -2 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -20
grep -E "^zz " "$OUT/gpu-tests.log"
echo "== after tests: $(( $(date +%s) - t0 )) s"
for b in sort:TestRouteAlignOneLaunch rank:TestRouteKernelTies; do
  (cd moe && timeout 60 ../.gpu/moe_brk_${b%%:*}.test -test.count=1 -test.run "${b#*:}" > /tmp/brk.log 2>&1); rc=$?
  echo "sabotaged ${b%%:*}: ${b#*:} rc=$rc (want 1) fails=$(grep -c -- '--- FAIL' /tmp/brk.log)"; grep -E -m3 "picked|one launch|routing|want" /tmp/brk.log | cut -c1-160
done
(cd moe && timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run "TestRouteAlignOneLaunch|TestRouteKernelTies") > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:" /tmp/memcheck.log | head -12
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 120 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64 --mode dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
timeout 100 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> /tmp/bench.log
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
grep -E "^speed vs peer|^peer: [0-9]+ |rror" /tmp/bench.log | head
rm -f "$OUT/triton_moe_anchor.json"
echo "== total $(( $(date +%s) - t0 )) s"
