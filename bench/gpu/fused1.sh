#!/usr/bin/env bash
# Fused routed path, first run: CUDA correctness of the fused kernels (fixtures,
# bitwise dual/graph, every tile, a full-size layer with the tuner's timings),
# then moe bench and the Triton fused-MoE peer in the same run.
# Build: bash bench/gpu/pack.sh ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd moe && GPUCTX_FULL_SIZE=deepseek-v2-lite timeout 240 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 230s \
  -test.run 'TestFusedFullSize|TestLayerFusedTiles/cuda|TestLayer(Fixtures|DualBitwise|GraphReplay|RandomPresets)/cuda') > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$?"; grep -cE -- '--- PASS' "$OUT/moe-tests.log"; grep -E -- '--- FAIL|panic|T=.*bucket' "$OUT/moe-tests.log" | head -30
row() { sed -n '/^| tokens/,/^$/p' "$1"; }
TOK=1,8,64,256,1024,4096
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens $TOK --mode single,dual --out "$OUT/v2.md" > "$OUT/bench.log" 2>&1
echo "== v2-lite default (small-batch <=16, fused above)"; row "$OUT/v2.md"
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,16 --mode single,dual --small-batch -1 --out "$OUT/v2-fused-small.md" >> "$OUT/bench.log" 2>&1
echo "== v2-lite fused at every size"; row "$OUT/v2-fused-small.md"
tail -3 "$OUT/bench.log"
PYTHONUNBUFFERED=1 timeout 200 python3 .gpu/peers/triton_fused_moe.py --preset deepseek-v2-lite --tokens $TOK > "$OUT/peer-v2.jsonl" 2> "$OUT/peer.log"
echo "peer rc=$?"; tail -2 "$OUT/peer.log"
python3 - "$OUT/peer-v2.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith('{'): continue
    d = json.loads(line)
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in d.items() if not isinstance(v, (dict, list))})
PY
