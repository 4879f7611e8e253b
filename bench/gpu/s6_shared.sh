#!/usr/bin/env bash
# Session 6, first GPU call: the fused shared expert's up blocks start before
# the sort ends (moe_shared_rows, commit e1488d8). The moe tests on CUDA; a
# moe test binary with moe_shared_rows sabotaged (rows shifted by one token:
# TestLayerSharedRowsEarly must fail); memcheck over the new test and the
# one-launch routing; the CLI of 33fbc27 (before the change) against this one
# on FusedShared at 1 and 8 tokens, twice each; then DeepSeek-V2-Lite and
# DeepSeek-V3 against the Triton peer in the same invocation.
# Build: bash bench/gpu/pack.sh . ./moe ./cmd/gpuctx (tests.txt: moe only),
# plus .gpu/moe-sab.test and .gpu/old/gpuctx-33fbc27.gz.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
row() { grep -E "^\| +[0-9]" "$1"; }
{
timeout 150 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -30
grep -E -- '--- (PASS|SKIP|FAIL): TestLayerSharedRowsEarly/cuda' "$OUT/gpu-tests.log" | head -10
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 60 ../.gpu/moe-sab.test -test.count=1 -test.run 'TestLayerSharedRowsEarly/cuda') > /tmp/sab.log 2>&1
echo "sabotaged rc=$? (want 1)"; grep -E -- "--- FAIL|early shared rows differ" /tmp/sab.log | head -8
(cd moe && timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestLayerSharedRowsEarly/cuda/deepseek-v2-lite|TestRouteAlignOneLaunch') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -A8 "Invalid|Error:|FAIL" /tmp/memcheck.log | head -20
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
gunzip -c .gpu/old/gpuctx-33fbc27.gz > /tmp/gpuctx-old; chmod +x /tmp/gpuctx-old
for c in /tmp/gpuctx-old .gpu/gpuctx /tmp/gpuctx-old .gpu/gpuctx; do
  timeout 60 $c moe bench --preset deepseek-v2-lite --tokens 1,8 --mode fused --small-batch -1 --out /tmp/b.md > /dev/null 2>&1
  echo "== $c deepseek-v2-lite fused rc=$?"; row /tmp/b.md | cut -c1-110
done
echo "== after A/B: $(( $(date +%s) - t0 )) s"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 120 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,64 --mode single,dual,fused,auto --small-batch -1 --iters 20 $P \
  --out "$OUT/moe-deepseek-v3.md" > /dev/null 2>> /tmp/bench.log
echo "== deepseek-v3 rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v3.md"; grep -E "^speed vs peer|^peer: [0-9]+ " /tmp/bench.log
rm -f "$OUT/triton_moe_anchor.json"
echo "== total $(( $(date +%s) - t0 )) s"
