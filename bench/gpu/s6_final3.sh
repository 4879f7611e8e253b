#!/usr/bin/env bash
# Session 6, last GPU call: s6_final2.sh (tests, memcheck, the three presets
# against the peer) with the tuner that times short kernels over several
# launches, then the CLI of e5227b0 (same kernels, the tuner before) against
# this one on FusedShared at 1 and 8 tokens, alternating, twice each.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx, plus
# .gpu/old/gpuctx-e5227b0.gz.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
row() { grep -E "^\| +[0-9]" "$1"; }
bash "$(dirname "$0")/s6_final2.sh"
notes() { grep -oE "T=[0-9]+ \(bucket [0-9]+, fused shared true\): up [a-z0-9]+, down [a-z0-9]+, [0-9.]+ us" "$1"; }
if [ -f .gpu/old/gpuctx-e5227b0.gz ]; then
gunzip -c .gpu/old/gpuctx-e5227b0.gz > /tmp/gpuctx-old; chmod +x /tmp/gpuctx-old
for c in /tmp/gpuctx-old .gpu/gpuctx /tmp/gpuctx-old .gpu/gpuctx; do
  timeout 40 $c moe bench --preset deepseek-v2-lite --tokens 1,8 --mode fused --small-batch -1 --out /tmp/b.md > /dev/null 2>&1
  echo "== $c deepseek-v2-lite fused rc=$?"; row /tmp/b.md | cut -c1-100; notes /tmp/b.md
done
fi
echo "== total $(( $(date +%s) - t0 )) s"
