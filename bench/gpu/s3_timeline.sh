#!/usr/bin/env bash
# Session 3, last call: the fused path queues the routed kernels before the
# side stream's shared expert. The moe test binary (dual and graph replay
# bitwise equal to single), moe bench dual/single at 8/64/256 tokens (graph
# replay: overlap column), and one eager dual forward traced -> timeline.png.
# Build: bash bench/gpu/pack.sh ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd moe && timeout 100 ../.gpu/moe.test -test.count=1 -test.v) > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$? pass=$(grep -c -- '--- PASS' "$OUT/moe-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/moe-tests.log")"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 8,64,256 --mode single,dual --out "$OUT/dual.md" > /dev/null 2>&1
echo "bench rc=$?"; grep -E "^\| +[0-9]" "$OUT/dual.md"
timeout 40 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 64 --mode dual --iters 5 --trace /tmp/dual.json --out /tmp/trace.md > /dev/null 2>&1
echo "trace rc=$?"
python3 - /tmp/dual.json "$OUT/timeline.png" <<'PY'
import json, sys
import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
d = json.load(open(sys.argv[1]))
names = {e["tid"]: e["args"]["name"] for e in d["traceEvents"] if e.get("ph") == "M" and e.get("name") == "thread_name"}
spans = [e for e in d["traceEvents"] if e.get("ph") == "X" and not e["name"].startswith("moe forward")]
last = max((e for e in d["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("moe forward")), key=lambda e: e["ts"])
spans = [e for e in spans if last["ts"] <= e["ts"] <= last["ts"] + last["dur"]]
tids = sorted({e["tid"] for e in spans})
fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(tids)))
for i, tid in enumerate(tids):
    for e in (e for e in spans if e["tid"] == tid):
        ax.broken_barh([(e["ts"] - last["ts"], e["dur"])], (i - 0.4, 0.8))
        if e["dur"] > last["dur"] / 25:
            ax.text(e["ts"] - last["ts"] + e["dur"] / 2, i, e["name"].replace("gpuctx_moe_", ""), ha="center", va="center", fontsize=7)
ax.set_yticks(range(len(tids)), [names.get(t, str(t)) for t in tids]); ax.set_xlabel("µs")
ax.set_title("one dual-stream forward, deepseek-v2-lite, 64 tokens, bf16, H200 (eager, from --trace)")
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=120)
for e in sorted(spans, key=lambda e: e["ts"]):
    print(f'{names.get(e["tid"], e["tid"])[:12]:12s} {e["ts"] - last["ts"]:8.1f} {e["dur"]:8.1f} {e["name"]}')
PY
