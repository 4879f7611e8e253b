#!/usr/bin/env bash
# Session 6, after the last benchmark: the refactor of 336b7d2 (moe_tile_begin
# and the bf16 helpers in moe_tile.cuh; NVRTC's PTX differs only in
# instruction order and register numbers) on the GPU: the moe tests on CUDA,
# memcheck over the early shared rows, DeepSeek-V2-Lite at 1-256 tokens
# against the peer.
# Build: moe.test and the CLI (bench/gpu/pack.sh . ./moe ./cmd/gpuctx).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
row() { grep -E "^\| +[0-9]" "$1"; }
timeout 100 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -2 /tmp/tests-summary.txt
echo "pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -20
(cd moe && timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 -test.v \
  -test.run 'TestLayerSharedRowsEarly/cuda') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1); $(grep -c -- '--- PASS' /tmp/memcheck.log) passed"
echo "== after tests: $(( $(date +%s) - t0 )) s"
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256 --mode single,dual,fused,auto \
  --small-batch -1 --peer .gpu/peers/triton_fused_moe.py --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
grep -E "^peer: [0-9]+ " /tmp/bench.log; rm -f "$OUT/triton_moe_anchor.json"
echo "== total $(( $(date +%s) - t0 )) s"
