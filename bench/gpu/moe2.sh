#!/usr/bin/env bash
# Second MoE run: the MoE tests on CUDA and the two presets' bench after the
# dual-mode fork moved to the counts copy, with the PyTorch peer in the same run.
# Build: bash bench/gpu/pack.sh ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN=${RUN:-.} bash .gpu/run.sh > "$OUT/tests-summary.txt" 2>&1; tail -3 "$OUT/tests-summary.txt"
grep -E -- '^--- (FAIL|SKIP)' "$OUT/gpu-tests.log" | head
TOK=${TOK:-1,8,64,256,1024,4096}
for p in deepseek-v2-lite qwen1.5-moe; do
  .gpu/gpuctx moe bench --preset $p --tokens "$TOK" --mode single,dual,auto --dtype bf16 \
    --out "$OUT/moe-$p.md" --plot "$OUT/moe-$p.png" > /dev/null 2>> "$OUT/bench.log"
  sed -n '/^| tokens/,/^$/p' "$OUT/moe-$p.md"
done
python3 bench/peers/torch_moe.py --preset deepseek-v2-lite --tokens "$TOK" > "$OUT/torch_moe.json" 2>> "$OUT/bench.log"
python3 -c "
import json,sys
d=json.load(open('$OUT/torch_moe.json'))
for r in d['rows']: print(r['tokens'], round(r['single_us'],1), round(r['dual_us'],1), round(r['shared_us'],1), round(r['routed_us'],1))
"
tail -3 "$OUT/bench.log"
