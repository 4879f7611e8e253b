#!/usr/bin/env bash
# gpuctx moe bench against the vLLM Triton fused-MoE peer, for every preset the
# peer has, in one device call (the peer runs inside each bench, after gpuctx).
# Build: bash bench/gpu/pack.sh . ./moe/...   Then (carry .gpu): bash bench/gpu/peer_triton.sh
# PRESETS, TOK and ITERS override the defaults. A device command may run 10 minutes:
# the default is two presets; run PRESETS="qwen3-30b-a3b deepseek-v3" in a second call.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
TOK=${TOK:-1,8,64,256,1024,4096}
peer=.gpu/peers/triton_fused_moe.py; [ -f "$peer" ] || peer=bench/peers/triton_fused_moe.py
for p in ${PRESETS:-deepseek-v2-lite qwen1.5-moe}; do
  it=${ITERS:-50}; tok=$TOK
  [ $p = deepseek-v3 ] && { it=${ITERS:-20}; tok=${TOK/,4096/}; }
  timeout 290 .gpu/gpuctx moe bench --preset $p --tokens "$tok" --mode single,dual --iters $it --peer "$peer" \
    --out "$OUT/moe-$p-vs-triton.md" --plot "$OUT/moe-$p-vs-triton.png" > /dev/null 2>> "$OUT/bench-$p.log"
  echo "== $p (exit $?)"; sed -n '/^| tokens/,$p' "$OUT/moe-$p-vs-triton.md" 2>/dev/null; tail -2 "$OUT/bench-$p.log"
done
