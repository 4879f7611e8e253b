#!/usr/bin/env bash
# peer.sh: gpuctx against its peers, as bench/RESULTS.md records them.
#   MoE: the three presets (deepseek-v2-lite, qwen3-30b-a3b, deepseek-v3) in one
#   `gpuctx moe bench --peer` invocation each, against vLLM's Triton fused MoE
#   (bench/peers/triton_fused_moe.py, its tuned tile table where vLLM has one):
#   the peer's weight distribution N(0, 0.02^2) and its number of rotated weight
#   sets (3; 2 for deepseek-v3), ROUNDS rounds alternating gpuctx and the peer,
#   every mode, the CLI's default token list (1-16384); tables, plots and logs in $OUT.
#   DTYPE=fp8: the layer with FP8 routed experts (--dtype fp8) against the FP8
#   peer (bench/peers/triton_fused_moe_fp8.py: vLLM's fp8_w8a8 Triton path);
#   the files are named moe-fp8-PRESET.*. The FP8 layer has no small-batch
#   kernels, so --small-batch is left out there.
#   GEMM=1: also `gpuctx gemm` against torch.matmul (bench/peers/torch_gemm.py).
# Build first (here): bash bench/gpu/pack.sh ./cmd/gpuctx   -- then on the GPU
# machine, from the checkout root, with .gpu carried:  bash bench/gpu/peer.sh
# Environment: PRESETS (default the three; one per device call keeps a call
# under 10 minutes), ROUNDS (3), TOKENS (a --tokens list; default the CLI's),
# ITERS (timed forwards per cell, default the CLI's 50; deepseek-v3 fits a
# 10-minute call with 20), LIMIT (seconds per preset, 590).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
table() { sed -n '/^| tokens/,/^$/p' "$1"; grep -E "^speed vs peer" "$1"; }
case "${DTYPE:-bf16}" in
  bf16) dt=(--small-batch -1); peer=.gpu/peers/triton_fused_moe.py; tag= ;;
  fp8) dt=(--dtype fp8); peer=.gpu/peers/triton_fused_moe_fp8.py; tag=fp8- ;;
  *) echo "peer.sh: DTYPE=$DTYPE: want bf16 or fp8" >&2; exit 2 ;;
esac
for p in ${PRESETS:-deepseek-v2-lite qwen3-30b-a3b deepseek-v3}; do
  modes=single,dual,auto,fused
  [ "$p" = qwen3-30b-a3b ] && modes=single,auto   # no shared expert: dual and fused are single
  timeout "${LIMIT:-590}" .gpu/gpuctx moe bench --preset "$p" --mode "$modes" "${dt[@]}" --rounds "${ROUNDS:-3}" \
    ${TOKENS:+--tokens "$TOKENS"} ${ITERS:+--iters "$ITERS"} --peer "$peer" \
    --out "$OUT/moe-$tag$p.md" --plot "$OUT/moe-$tag$p.png" > /dev/null 2> "$OUT/bench-$tag$p.log"
  echo "== $p ${DTYPE:-bf16} rc=$? after $(( $(date +%s) - t0 )) s"; table "$OUT/moe-$tag$p.md"
  grep -E "^gpuctx: " "$OUT/bench-$tag$p.log"
done
rm -f "$OUT/triton_moe_anchor.json" "$OUT/triton_moe_fp8_anchor.json"
if [ -n "${GEMM:-}" ]; then
  {
    for args in "--m 8192 --n 8192 --k 8192 --dtype bf16" "--m 8192 --n 8192 --k 8192 --dtype bf16 --lt" \
        "--m 4096 --n 4096 --k 4096 --dtype f32" "--m 4096 --n 4096 --k 4096 --dtype tf32"; do
      .gpu/gpuctx gemm $args --iters 20 --repeats 7 --json | tr -d '\n'; echo
    done
    for s in 1 2 4 8; do
      .gpu/gpuctx gemm --m 256 --n 256 --k 256 --dtype f32 --streams $s --iters 200 --repeats 5 --json | tr -d '\n'; echo
    done
    python3 .gpu/peers/torch_gemm.py | tr -d '\n'; echo
  } > "$OUT/gemm.jsonl" 2> "$OUT/gemm.log"
  echo "== gemm rc=$?"; cat "$OUT/gemm.jsonl"
fi
echo "== total $(( $(date +%s) - t0 )) s"
