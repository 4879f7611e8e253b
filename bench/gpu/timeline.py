#!/usr/bin/env python3
"""Draw one MoE forward of a gpuctx trace (--trace FILE.json) as a timeline.

    python3 bench/gpu/timeline.py TRACE.json [OUT.png] [--title TITLE]

Takes the last "moe forward" span of the trace and the spans inside it, prints
them one per line (stream, start and duration in µs from the forward's start,
name) and, given OUT.png, draws one row per stream (matplotlib, imported only
then). The README's picture (bench/timeline-dual-h200.png) was drawn this way
from `gpuctx moe bench --tokens 64 --mode dual --trace` on the H200.
"""
import argparse
import json


def forward_spans(trace):
    """Returns (names by track id, the last forward span, the spans inside it)."""
    ev = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    fwd = [e for e in ev if e.get("ph") == "X" and e["name"].startswith("moe forward")]
    if not fwd:
        raise SystemExit("timeline.py: the trace has no 'moe forward' span (trace moe run or moe bench)")
    last = max(fwd, key=lambda e: e["ts"])
    spans = [e for e in ev if e.get("ph") == "X" and not e["name"].startswith("moe forward")
             and last["ts"] <= e["ts"] <= last["ts"] + last["dur"]]
    return names, last, sorted(spans, key=lambda e: e["ts"])


def draw(names, last, spans, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tids = sorted({e["tid"] for e in spans})
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(tids)))
    for i, tid in enumerate(tids):
        for e in (e for e in spans if e["tid"] == tid):
            ax.broken_barh([(e["ts"] - last["ts"], e["dur"])], (i - 0.4, 0.8))
            if e["dur"] > last["dur"] / 25:
                ax.text(e["ts"] - last["ts"] + e["dur"] / 2, i, e["name"].replace("gpuctx_moe_", ""),
                        ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(tids)), [names.get(t, str(t)) for t in tids])
    ax.set_xlabel("µs")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("out", nargs="?")
    p.add_argument("--title", default="one dual-stream forward, deepseek-v2-lite, 64 tokens, bf16, H200 (eager, from --trace)")
    a = p.parse_args()
    with open(a.trace) as f:
        names, last, spans = forward_spans(json.load(f))
    for e in spans:
        print(f'{str(names.get(e["tid"], e["tid"]))[:12]:12s} {e["ts"] - last["ts"]:8.1f} {e["dur"]:8.1f} {e["name"]}')
    if a.out:
        draw(names, last, spans, a.out, a.title)


if __name__ == "__main__":
    main()
