#!/usr/bin/env bash
# Session 3, small batches: one-warp m16n16 tiles (twice the blocks of m16n32
# for 1-8 tokens). The moe test binary (every tile bitwise equal to its
# family), then moe bench with the Triton peer at 1 and 8 tokens.
# Build: bash bench/gpu/pack.sh ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd moe && timeout 80 ../.gpu/moe.test -test.count=1 -test.v) > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$? pass=$(grep -c -- '--- PASS' "$OUT/moe-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/moe-tests.log")"
grep -E -- '--- FAIL' "$OUT/moe-tests.log" | head
export GPUCTX_KERNEL_CACHE=/tmp/kcache
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 50 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8 --mode single --small-batch -1 $P --out "$OUT/qwen3-small.md" > /dev/null 2>&1
echo "qwen3 rc=$?"; grep -E "^\| +[0-9]|T=(1|8) " "$OUT/qwen3-small.md" | cut -c1-400
timeout 50 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8 --mode single,dual,fused,auto --small-batch -1 $P --out "$OUT/dsv2-small.md" > /dev/null 2>&1
echo "dsv2 rc=$?"; grep -E "^\| +[0-9]|T=(1|8) " "$OUT/dsv2-small.md" | cut -c1-400
