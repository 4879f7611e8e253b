#!/usr/bin/env bash
# trace.sh: timelines for ui.perfetto.dev and the README's picture: traces of
# moe run, moe bench (64 tokens, dual: drawn by timeline.py into
# $OUT/timeline.png) and gemm on two streams, with a summary of each.
# Build first (here): bash bench/gpu/pack.sh ./cmd/gpuctx   (python3 with
# matplotlib draws the picture; without it timeline.py prints the spans only)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FIX=moe/testdata/deepseek_v2_greedy
.gpu/gpuctx moe run --model $FIX --input $FIX/input.safetensors --output "$OUT/y.safetensors" --dtype bf16 --mode dual --trace "$OUT/moe-run.json" -v
.gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 64 --mode dual --sets 1 --trace "$OUT/moe-bench.json" --out "$OUT/moe-bench.md" > /dev/null
.gpu/gpuctx gemm --m 4096 --n 4096 --k 4096 --dtype bf16 --streams 2 --trace "$OUT/gemm.json" | tail -3
python3 "$(dirname "$0")/timeline.py" "$OUT/moe-bench.json" "$OUT/timeline.png" | tail -20
python3 - "$OUT" <<'PY'
import json, sys, collections
for f in ("moe-run.json", "moe-bench.json", "gemm.json"):
    ev = json.load(open(f"{sys.argv[1]}/{f}"))["traceEvents"]
    spans = [e for e in ev if e["ph"] == "X"]
    top = collections.Counter()
    for e in spans:
        top[e["name"]] += e["dur"]
    print(f, len(spans), "spans on", len({e["tid"] for e in spans}), "tracks; busiest:",
          ", ".join(f"{n} {us:.0f} us" for n, us in top.most_common(6)))
PY
