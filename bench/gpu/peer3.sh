#!/usr/bin/env bash
# The three presets of issue 8 against the Triton peer, each in one moe bench
# invocation (DeepSeek-V2-Lite 1-4096 tokens in every mode with the plot,
# Qwen3-30B-A3B 1-4096 single, DeepSeek-V3 1, 64, 1024 in every mode); tables
# in $OUT. Run from the checkout root after pack.sh; T0 = the caller's start
# time (date +%s) for the elapsed seconds it prints. Used by s6_final*.sh.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=${T0:-$(date +%s)}
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 110 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" --plot "$OUT/moe-deepseek-v2-lite.png" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
timeout 90 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> /tmp/bench.log
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
timeout 120 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,64,1024 --mode single,dual,fused,auto --small-batch -1 --iters 20 $P \
  --out "$OUT/moe-deepseek-v3.md" > /dev/null 2>> /tmp/bench.log
echo "== deepseek-v3 rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v3.md"; grep -E "^speed vs peer|^peer: [0-9]+ " /tmp/bench.log
rm -f "$OUT/triton_moe_anchor.json"
