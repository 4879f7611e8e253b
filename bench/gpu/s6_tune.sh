#!/usr/bin/env bash
# Session 6, fifth GPU call: the tuner times each up tile together with the
# one-launch routing ahead of it when the shared expert is fused (commit
# after e5227b0). The moe tests that tune on CUDA; then DeepSeek-V2-Lite (1, 8
# tokens) and DeepSeek-V3 (1 token) against the peer; then the CLI of e5227b0
# (.gpu/old/gpuctx-e5227b0.gz, same kernels, old tuner) against this one on
# FusedShared, alternating, twice each.
# Build: bash bench/gpu/pack.sh . ./moe ./cmd/gpuctx (tests.txt: moe only).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
row() { grep -E "^\| +[0-9]" "$1"; }
notes() { grep -oE "T=[0-9]+ \(bucket [0-9]+, fused shared true\): up [a-z0-9]+, down [a-z0-9]+, [0-9.]+ us \([a-z+ ]+" "$1"; }
(cd moe && timeout 120 ../.gpu/moe.test -test.count=1 -test.v \
  -test.run 'TestLayerFusedShared|TestLayerSharedRowsEarly|TestLayerAutoMeasured|TestLayerGraphReplay|TestLayerDualBitwise') > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$? $(grep -c -- '--- PASS' "$OUT/moe-tests.log") passed, $(grep -c -- '--- FAIL' "$OUT/moe-tests.log") failed"
grep -E -A3 -- '--- FAIL|panic' "$OUT/moe-tests.log" | head -20
echo "== after tests: $(( $(date +%s) - t0 )) s"
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"; notes "$OUT/moe-deepseek-v2-lite.md"
timeout 90 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1 --mode single,dual,fused,auto --small-batch -1 --iters 20 $P \
  --out "$OUT/moe-deepseek-v3.md" > /dev/null 2>> /tmp/bench.log
echo "== deepseek-v3 rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v3.md"; notes "$OUT/moe-deepseek-v3.md"
grep -E "^speed vs peer|^peer: [0-9]+ " /tmp/bench.log
rm -f "$OUT/triton_moe_anchor.json"
gunzip -c .gpu/old/gpuctx-e5227b0.gz > /tmp/gpuctx-old; chmod +x /tmp/gpuctx-old
for c in /tmp/gpuctx-old .gpu/gpuctx /tmp/gpuctx-old .gpu/gpuctx; do
  timeout 40 $c moe bench --preset deepseek-v2-lite --tokens 1,8 --mode fused --small-batch -1 --out /tmp/b.md > /dev/null 2>&1
  echo "== $c deepseek-v2-lite fused rc=$?"; row /tmp/b.md | cut -c1-100; notes /tmp/b.md
done
echo "== total $(( $(date +%s) - t0 )) s"
