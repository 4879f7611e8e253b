#!/usr/bin/env bash
# Session 3, call 2: the warpgroup (wgmma, sm_90a) expert GEMM tiles.
# Every CUDA test binary (TestLayerFusedTiles runs each wgmma tile against the
# first one bitwise and against the reference), compute-sanitizer memcheck on
# the wgmma tiles, then moe bench with the tuner choosing among all tiles, the
# Triton peer in the same invocation (deepseek-v2-lite 256/1024/4096,
# qwen3-30b-a3b 1024/4096), and the dual-stream timeline PNG for the README.
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
S="$OUT/summary.txt"
{
timeout 150 bash .gpu/run.sh > /tmp/tests-summary.txt 2>&1; echo "tests rc=$?"; tail -3 /tmp/tests-summary.txt
grep -c -- '--- PASS' "$OUT/gpu-tests.log"; grep -E -- '--- FAIL|panic|wgmma|warpgroup' "$OUT/gpu-tests.log" | head -30
echo "== after tests: $(( $(date +%s) - t0 )) s"
(cd moe && timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestLayerFusedTiles/cuda/m(64n128|128n128)k64g[12]s4') > /tmp/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' /tmp/memcheck.log | tail -1)"; grep -E -B2 -A8 "Invalid|Error" /tmp/memcheck.log | head -30
echo "== after memcheck: $(( $(date +%s) - t0 )) s"
} > "$S" 2>&1
cat "$S"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
timeout 200 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 256,1024,4096 --mode single,dual,auto \
  --peer .gpu/peers/triton_fused_moe.py --out "$OUT/dsv2.md" > /tmp/dsv2.txt 2>&1
echo "dsv2 rc=$?"; tail -5 /tmp/dsv2.txt; grep -E "^\| +[0-9]" "$OUT/dsv2.md"
echo "== after dsv2: $(( $(date +%s) - t0 )) s"
timeout 150 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1024,4096 --mode single,dual,auto \
  --peer .gpu/peers/triton_fused_moe.py --out "$OUT/qwen3.md" > /tmp/qwen3.txt 2>&1
echo "qwen3 rc=$?"; tail -3 /tmp/qwen3.txt; grep -E "^\| +[0-9]" "$OUT/qwen3.md"
echo "== after qwen3: $(( $(date +%s) - t0 )) s"
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 64 --mode dual --trace /tmp/dual.json --out /tmp/dual.md > /dev/null 2>&1
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
PY
echo "== total $(( $(date +%s) - t0 )) s"
