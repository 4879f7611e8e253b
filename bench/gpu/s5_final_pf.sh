#!/usr/bin/env bash
# Session 5, last GPU call: s5_final.sh on the commit with the shared-expert
# L2 prefetch (memcheck also over TestLayerFusedShared, which runs it), then
# the previous commit's CLI (.gpu/prev/gpuctx-d1b46bd.gz, no prefetch) on the
# same small batches in the same call as the A/B.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
NORUN=1 NONCU=1 MEMCHECK='TestRouteAlignOneLaunch|TestRouteKernelTies|TestLayerFusedShared|TestLayerFusedTiles/cuda/m128n(128|256)k64g2s4p4' \
  bash "$(dirname "$0")/s4_final.sh"
row() { grep -E "^\| +[0-9]" "$1"; }
gunzip -c .gpu/prev/gpuctx-d1b46bd.gz > /tmp/prev && chmod +x /tmp/prev
for bin in .gpu/gpuctx /tmp/prev; do
  timeout 60 $bin moe bench --preset deepseek-v2-lite --tokens 1,8 --mode fused --small-batch -1 --out /tmp/ab.md > /dev/null 2>&1
  echo "== A/B $bin deepseek-v2-lite fused rc=$?"; row /tmp/ab.md
done
