#!/usr/bin/env bash
# Fourth MoE run: graphs. Root and MoE tests on CUDA (graph capture tests
# included), then the bench with graphs (default) and without, crossover of the
# small-batch path, both presets, and the PyTorch peer in the same run.
# Build: bash bench/gpu/pack.sh . ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN=${RUN:-.} bash .gpu/run.sh > "$OUT/tests-summary.txt" 2>&1; tail -3 "$OUT/tests-summary.txt"
grep -E -- '^--- (FAIL|SKIP)|^\s+--- FAIL' "$OUT/gpu-tests.log" | head
grep -E -- '--- (PASS|FAIL).*TestGraph|--- (PASS|FAIL): TestLayerGraphReplay' "$OUT/gpu-tests.log" | head
row() { sed -n '/^| tokens/,/^$/p' "$1"; }
.gpu/gpuctx moe bench --tokens 1,4,8,16,32,64 --mode single,dual --small-batch 100000 --out "$OUT/cross-small.md" >/dev/null 2>>"$OUT/bench.log"
echo "== small-batch kernels, graphs, forced for every size"; row "$OUT/cross-small.md"
TOK=1,8,64,256,1024,4096
.gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens $TOK --mode single,dual \
  --out "$OUT/moe-deepseek-v2-lite.md" --plot "$OUT/moe-deepseek-v2-lite.png" >/dev/null 2>>"$OUT/bench.log"
.gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,16 --mode single,dual --no-graphs --out "$OUT/nographs.md" >/dev/null 2>>"$OUT/bench.log"
.gpu/gpuctx moe bench --preset qwen1.5-moe --tokens $TOK --mode single,dual --out "$OUT/moe-qwen1.5-moe.md" >/dev/null 2>>"$OUT/bench.log"
echo "== v2-lite default"; row "$OUT/moe-deepseek-v2-lite.md"; echo "== v2-lite no graphs"; row "$OUT/nographs.md"
echo "== qwen1.5 default"; row "$OUT/moe-qwen1.5-moe.md"
python3 bench/peers/torch_moe.py --preset deepseek-v2-lite --tokens $TOK > "$OUT/torch_moe.json" 2>>"$OUT/bench.log"
python3 -c "
import json
d=json.load(open('$OUT/torch_moe.json'))
for r in d['rows']: print('torch', r['tokens'], round(r['single_us'],1), round(r['dual_us'],1), round(r['shared_us'],1), round(r['routed_us'],1))
"
tail -2 "$OUT/bench.log"
