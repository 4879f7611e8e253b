#!/usr/bin/env bash
# coldstart.sh: first-run cost on the GPU machine (issue 24): moe run -v on a
# DeepSeek-V2-Lite-sized layer (written by moe init) with a cold, then a warm
# kernel cache, and the wall time of a first and a second moe bench.
# Build first (here): bash bench/gpu/pack.sh ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FIX=/tmp/dsv2
timeout 120 .gpu/gpuctx moe init --preset deepseek-v2-lite --dir $FIX > /dev/null 2>&1 || echo "moe init failed"
export GPUCTX_KERNEL_CACHE=/tmp/kcache; rm -rf "$GPUCTX_KERNEL_CACHE"
TIMEFORMAT="wall %R s"
for run in "cold dual" "warm dual" "warm auto"; do
  set -- $run
  echo "== moe run -v --mode $2, $1 kernel cache"
  time timeout 120 .gpu/gpuctx moe run --model $FIX --input $FIX/input.safetensors --output /tmp/y.safetensors --dtype bf16 --mode "$2" -v 2>&1 >/dev/null
done
rm -rf "$GPUCTX_KERNEL_CACHE"
for run in cold warm; do
  echo "== moe bench --tokens 1,64 --sets 1, $run kernel cache"
  time timeout 120 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,64 --sets 1 --out "$OUT/coldstart-$run.md" > /dev/null 2>&1
done
ls -la "$GPUCTX_KERNEL_CACHE" | head
