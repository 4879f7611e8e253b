#!/usr/bin/env bash
# gpuctx moe bench against the PyTorch peer for the other presets, in one device
# call, with a ratio table. Build: bash bench/gpu/pack.sh ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOK=1,8,64,256,1024
for p in qwen1.5-moe qwen3-30b-a3b deepseek-v3; do
  it=50; [ $p = deepseek-v3 ] && it=20
  timeout 300 .gpu/gpuctx moe bench --preset $p --tokens $TOK --mode single,dual --iters $it --json > "$OUT/gpuctx-$p.json" 2>>"$OUT/bench.log"
  timeout 200 python3 bench/peers/torch_moe.py --preset $p --tokens $TOK > "$OUT/torch-$p.json" 2>>"$OUT/bench.log"
done
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
for p in ["qwen1.5-moe", "qwen3-30b-a3b", "deepseek-v3"]:
    try:
        g = json.load(open(f"{out}/gpuctx-{p}.json")); t = json.load(open(f"{out}/torch-{p}.json"))
    except Exception as e:
        print(p, "missing:", e); continue
    tr = {r["tokens"]: r for r in t["rows"]}
    print(f"== {p}: | tokens | gpuctx single | gpuctx dual | PyTorch single | PyTorch dual | ratio |")
    for r in g["rows"]:
        T = r["tokens"]
        ms = r["median_us"]
        s, d = ms.get("single"), ms.get("dual")
        x = tr.get(T)
        if x is None or s is None: print(T, r); continue
        best = min(v for v in (s, d) if v is not None); tb = min(x["single_us"], x["dual_us"])
        print(f"| {T} | {s:.1f} | {d if d is None else round(d,1)} | {x['single_us']:.1f} | {x['dual_us']:.1f} | {tb/best:.2f} |")
PY
tail -3 "$OUT/bench.log"
