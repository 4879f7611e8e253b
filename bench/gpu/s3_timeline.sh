#!/usr/bin/env bash
# Session 3, last call: the fused path queues the routed kernels before the
# side stream's shared expert. The moe test binary (dual and graph replay
# bitwise equal to single), moe bench dual/single at 8/64/256 tokens (graph
# replay: overlap column), and one eager dual forward traced -> timeline.png.
# Build: bash bench/gpu/pack.sh ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd moe && timeout 100 ../.gpu/moe.test -test.count=1 -test.v) > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$? pass=$(grep -c -- '--- PASS' "$OUT/moe-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/moe-tests.log")"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 8,64,256 --mode single,dual --out "$OUT/dual.md" > /dev/null 2>&1
echo "bench rc=$?"; grep -E "^\| +[0-9]" "$OUT/dual.md"
timeout 40 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 64 --mode dual --iters 5 --trace /tmp/dual.json --out /tmp/trace.md > /dev/null 2>&1
echo "trace rc=$?"
python3 bench/gpu/timeline.py /tmp/dual.json "$OUT/timeline.png"
