#!/usr/bin/env bash
# ncu: the duration of every gpuctx MoE kernel in the first forwards of a
# deepseek-v2-lite layer at 1024 and 4096 tokens (where the routed path's time
# exceeds its two expert GEMMs), tile forced so that no tuning runs.
# Build: bash bench/gpu/pack.sh ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for spec in "1024 m128n64k64w2x2s3" "4096 m64n64k64w2x2s4"; do
  set -- $spec
  timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:gpuctx_moe -c 14 \
    .gpu/gpuctx moe bench --tokens $1 --mode single --small-batch -1 --tile $2 --iters 2 --warmup 1 > "$OUT/ncu-stages-$1.txt" 2>&1
  echo "== T=$1 rc=$?"
  grep -E "^  gpuctx_moe|gpu__time_duration" "$OUT/ncu-stages-$1.txt" | paste - - | awk '{print $1, $(NF-1), $NF}' | head -14
done
