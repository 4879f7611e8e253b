#!/usr/bin/env bash
# Session 4, a short call after s4_final2.sh: the shared expert forked before
# the router in dual mode. The moe test binary on CUDA, then moe bench
# (DeepSeek-V2-Lite, 1-256 tokens, single/dual/fused) against the peer.
# Build: bash bench/gpu/pack.sh ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
(cd moe && timeout 100 ../.gpu/moe.test -test.count=1 -test.v) > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$? pass=$(grep -c -- '--- PASS' "$OUT/moe-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/moe-tests.log") $(( $(date +%s) - t0 )) s"
grep -E -A3 -- '--- FAIL|panic' "$OUT/moe-tests.log" | head -20
timeout 100 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256 --mode single,dual,fused \
  --small-batch -1 --peer .gpu/peers/triton_fused_moe.py --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| +[0-9]" "$OUT/moe-deepseek-v2-lite.md"; grep -E "^speed vs peer" /tmp/bench.log
rm -f "$OUT/triton_moe_anchor.json"
