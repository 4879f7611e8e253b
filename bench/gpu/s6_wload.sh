#!/usr/bin/env bash
# (The GPUCTX_MOE_WLOAD knob it measured was reverted after this call, 9b688e7: build
# it at commit 939cb35.)
# Session 6, second GPU call: load hints for the expert GEMMs' weight tiles
# (GPUCTX_MOE_WLOAD: plain, pf128, pf256 = cp.async's L2 prefetch size;
# evict = evict_first L2 policy; evict256 = both). One CLI; each variant
# compiles its own kernels. DeepSeek-V2-Lite FusedShared at 1, 8, 256 tokens
# (the tuner's notes time every tile's up and down kernel), Qwen3 at 8 and 256,
# then DeepSeek-V2-Lite at 4096 (dual) for three variants, the plain one twice
# (first and last) to see the drift. Full reports land in $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
export GPUCTX_KERNEL_CACHE=/tmp/kc
row() { grep -E "^\| +[0-9]" "$1" | cut -c1-120; }
for v in plain pf128 pf256 evict evict256; do
  GPUCTX_MOE_WLOAD=$v timeout 120 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,256 --mode fused \
    --small-batch -1 --out "$OUT/w-dsv2-$v.md" > /dev/null 2>&1
  echo "== $v deepseek-v2-lite fused rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/w-dsv2-$v.md"
  grep -oE "T=[0-9]+ \(bucket [0-9]+, fused shared true\): up [a-z0-9]+, down [a-z0-9]+, [0-9.]+ us" "$OUT/w-dsv2-$v.md"
  GPUCTX_MOE_WLOAD=$v timeout 60 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 8,256 --mode single \
    --small-batch -1 --out "$OUT/w-qwen3-$v.md" > /dev/null 2>&1
  echo "== $v qwen3 single rc=$?"; row "$OUT/w-qwen3-$v.md"
  grep -oE "T=[0-9]+ \(bucket [0-9]+, fused shared false\): up [a-z0-9]+, down [a-z0-9]+, [0-9.]+ us" "$OUT/w-qwen3-$v.md"
done
for v in plain pf256 evict256 plain; do
  GPUCTX_MOE_WLOAD=$v timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 4096 --mode dual \
    --small-batch -1 --out "$OUT/w4096-$v.md" > /dev/null 2>&1
  echo "== $v deepseek-v2-lite 4096 dual rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/w4096-$v.md"
  grep -oE "T=[0-9]+ \(bucket [0-9]+, fused shared false\): up [a-z0-9]+, down [a-z0-9]+, [0-9.]+ us" "$OUT/w4096-$v.md"
done
echo "== total $(( $(date +%s) - t0 )) s"
