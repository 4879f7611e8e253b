#!/usr/bin/env python3
"""PyTorch peer for gpuctx's MoE layer benchmark.

One MoE layer (router, routed experts, shared expert) in bf16 with random
weights (nn.Linear-like scales), for the presets of the Go package moe. Routed
experts go through torch._grouped_mm when it is present and works, otherwise an
eager per-expert loop. Variants timed per token count (1, 8, 64, 256, 1024, 4096):

  single   router + routed + shared on one stream
  dual     shared expert on a side stream, joined before the sum
  shared   the shared expert alone
  routed   router + routed experts alone

with CUDA graph replay (grouped_mm path) or eagerly (loop path), warm-up first,
median of many replays timed with CUDA events, rotating among several inputs.
Also prints the floor max(bytes of the weights the batch touches / copy
bandwidth, FLOPs / matmul rate) with the DESIGN.md ceilings (4.15 TB/s,
760 TFLOP/s). Prints one JSON object on stdout; progress on stderr. Fails loudly.

  python3 bench/peers/torch_moe.py [--preset deepseek-v2-lite] [--tokens 1,8,64]
"""

import argparse
import json
import math
import platform
import statistics
import sys

import torch
import torch.nn.functional as F

PRESETS = {
    # family, H, E, K, I, shared width, scoring, method, groups, topk_groups, norm, scale, shared gate
    "deepseek-v2-lite": dict(family="deepseek_v2", H=2048, E=64, K=6, I=1408, S=2 * 1408, scoring="softmax",
                             method="greedy", G=1, TG=1, norm=False, scale=1.0, sgate=False),
    "deepseek-v3": dict(family="deepseek_v3", H=7168, E=256, K=8, I=2048, S=2048, scoring="sigmoid",
                        method="noaux_tc", G=8, TG=4, norm=True, scale=2.5, sgate=False),
    "qwen1.5-moe": dict(family="qwen2_moe", H=2048, E=60, K=4, I=1408, S=5632, scoring="softmax",
                        method="greedy", G=1, TG=1, norm=False, scale=1.0, sgate=True),
    "qwen3-30b-a3b": dict(family="qwen3_moe", H=2048, E=128, K=8, I=768, S=0, scoring="softmax",
                          method="greedy", G=1, TG=1, norm=True, scale=1.0, sgate=False),
}
COPY_BW = 4.15e12
MATMUL_RATE = 760e12


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class Layer:
    def __init__(self, p, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        H, E, I, S = p["H"], p["E"], p["I"], p["S"]

        def u(shape, fan_in):
            b = 1 / math.sqrt(fan_in)
            return ((torch.rand(shape, device="cuda", generator=g) * 2 - 1) * b).to(torch.bfloat16)

        self.p = p
        self.router = u((E, H), H)
        self.router_f32 = self.router.float()
        self.bias = (torch.rand(E, device="cuda", generator=g) * 0.1 - 0.05) if p["method"] == "noaux_tc" else None
        self.gate_up = u((E, 2 * I, H), H)  # transformers 5 layout: gate rows first
        self.down = u((E, H, I), I)
        if S:
            self.sg, self.su, self.sd = u((S, H), H), u((S, H), H), u((H, S), S)
            self.sgate = u((1, H), H) if p["sgate"] else None

    def route(self, x):
        p = self.p
        logits = x.float() @ self.router_f32.T
        scores = logits.sigmoid() if p["scoring"] == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.bias if self.bias is not None else scores
        if p["method"] in ("group_limited_greedy", "noaux_tc"):
            T = x.shape[0]
            grouped = choice.view(T, p["G"], -1)
            gs = grouped.max(-1).values if p["method"] == "group_limited_greedy" else grouped.topk(2, -1)[0].sum(-1)
            gidx = gs.topk(p["TG"], dim=-1, sorted=False)[1]
            mask = torch.zeros_like(gs).scatter_(1, gidx, 1).unsqueeze(-1).expand_as(grouped).reshape(T, -1)
            choice = choice.masked_fill(mask == 0, 0.0)
        idx = choice.topk(p["K"], dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if p["norm"]:
            w = w / (w.sum(-1, keepdim=True) + (1e-20 if p["family"] == "deepseek_v3" else 0))
        if p["family"].startswith("deepseek"):
            w = w * p["scale"]
        return idx, w

    def routed_grouped(self, x):
        T, H = x.shape
        K, E, I = self.p["K"], self.p["E"], self.p["I"]
        idx, w = self.route(x)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        tok = order // K
        # bincount syncs with the host (not capturable); a scatter-add does not.
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        xs = x[tok]
        gu = torch._grouped_mm(xs, self.gate_up.transpose(-2, -1), offs=offs)
        a = F.silu(gu[:, :I]) * gu[:, I:]
        ys = torch._grouped_mm(a, self.down.transpose(-2, -1), offs=offs)
        ys = ys * w.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
        out.index_add_(0, tok, ys.float())
        return out.to(x.dtype)

    def routed_loop(self, x):
        T, H = x.shape
        I = self.p["I"]
        idx, w = self.route(x)
        out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
        for e in idx.unique().tolist():
            t, k = torch.where(idx == e)
            gu = x[t] @ self.gate_up[e].T
            y = (F.silu(gu[:, :I]) * gu[:, I:]) @ self.down[e].T
            out.index_add_(0, t, (y.float() * w[t, k].unsqueeze(-1)))
        return out.to(x.dtype)

    def shared(self, x):
        y = (F.silu(x @ self.sg.T) * (x @ self.su.T)) @ self.sd.T
        if self.sgate is not None:
            y = y * torch.sigmoid(x @ self.sgate.T)
        return y


def check(layer, routed_fn):
    """Compare the bf16 routed path with a float64 loop on a few tokens."""
    x = (torch.randn(5, layer.p["H"], device="cuda") * 1.0).to(torch.bfloat16)
    got = routed_fn(x).double()
    idx, w = layer.route(x)
    I = layer.p["I"]
    ref = torch.zeros_like(got)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            gu = layer.gate_up[e].double() @ x[t].double()
            ref[t] += float(w[t, k]) * (layer.down[e].double() @ (F.silu(gu[:I]) * gu[I:]))
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if not err < 3e-2:
        raise RuntimeError(f"routed path differs from the float64 loop: rel err {err:.3g}")
    return err


def time_fn(fn, xs, iters, warmup, graph):
    side = torch.cuda.Stream()
    if graph:
        graphs, outs = [], []
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                for x in xs:
                    fn(x, side)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for x in xs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs.append(fn(x, side))
            graphs.append(g)
        run = lambda i: graphs[i % len(graphs)].replay()  # noqa: E731
    else:
        run = lambda i: fn(xs[i % len(xs)], side)  # noqa: E731
    for i in range(warmup):
        run(i)
    torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        st[i].record()
        run(i)
        en[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(st, en))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--inputs", type=int, default=3, help="input buffers rotated between timings")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--loop", action="store_true", help="force the per-expert loop instead of _grouped_mm")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("FATAL: torch.cuda.is_available() is False; this script needs an NVIDIA GPU")
    dev = torch.cuda.get_device_name(0)
    log(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, device {dev}")
    p = PRESETS[args.preset]
    layer = Layer(p, seed=1)
    mode = "loop"
    routed = layer.routed_loop
    if not args.loop and hasattr(torch, "_grouped_mm"):
        try:
            err = check(layer, layer.routed_grouped)
            mode, routed = "grouped_mm", layer.routed_grouped
            log(f"torch._grouped_mm path OK (rel err vs float64 {err:.2e})")
        except Exception as e:  # noqa: BLE001
            log(f"torch._grouped_mm unusable ({e!r}); falling back to the per-expert loop")
    if mode == "loop":
        log(f"loop path rel err vs float64 {check(layer, layer.routed_loop):.2e}")
    graph = mode == "grouped_mm" and not args.no_graph
    has_shared = p["S"] > 0

    def single(x, side):
        y = routed(x)
        return y + layer.shared(x) if has_shared else y

    def dual(x, side):
        if not has_shared:
            return routed(x)
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            sh = layer.shared(x)
        y = routed(x)
        main.wait_stream(side)
        return y + sh

    rows = []
    H, E, K, I, S = p["H"], p["E"], p["K"], p["I"], p["S"]
    for T in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(T)
        xs = [torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(args.inputs)]
        touched = layer.route(xs[0])[0].unique().numel()
        bytes_ = 2 * (touched * 3 * I * H + 3 * S * H + E * H)
        flops = 2 * T * (K * 3 * I * H + 3 * S * H + E * H)
        floor = max(bytes_ / COPY_BW, flops / MATMUL_RATE) * 1e6
        row = dict(tokens=T, experts_touched=touched, floor_us=floor)
        for name, fn in (("single", single), ("dual", dual), ("routed", lambda x, s: routed(x))) + \
                ((("shared", lambda x, s: layer.shared(x)),) if has_shared else ()):
            row[name + "_us"] = time_fn(fn, xs, args.iters, args.warmup, graph)
        log(json.dumps(row))
        rows.append(row)
    print(json.dumps(dict(peer="torch_moe", preset=args.preset, config=p, routed_path=mode, cuda_graph=graph,
                          dtype="bfloat16", device=dev, torch=torch.__version__, cuda=torch.version.cuda,
                          python=platform.python_version(), iters=args.iters, rows=rows), indent=2))


if __name__ == "__main__":
    main()
