#!/usr/bin/env python3
"""PyTorch matmul ceiling: bf16 8192^3 and f32 4096^3 (strict FP32, and TF32).

Times torch.matmul with CUDA events: warm-up first, then the median of many
single-call timings, rotating through several random input sets (so the inputs
are not L2-resident). Prints one JSON object on stdout; progress goes to stderr.
Fails loudly (non-zero exit) when there is no CUDA device.

  python3 bench/peers/torch_gemm.py [--iters 50] [--sets 3]
"""

import argparse
import json
import platform
import statistics
import sys

import torch


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def bench(n, dtype, iters, sets, warmup, tf32):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    gen = torch.Generator(device="cuda").manual_seed(n)
    ins = []
    for _ in range(sets):
        a = torch.randn(n, n, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
        b = torch.randn(n, n, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
        ins.append((a, b))
    c = torch.empty(n, n, device="cuda", dtype=dtype)
    for i in range(warmup):
        a, b = ins[i % sets]
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    times = []
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        a, b = ins[i % sets]
        starts[i].record()
        torch.matmul(a, b, out=c)
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]
    if not torch.isfinite(c).all():
        raise RuntimeError(f"non-finite result for {dtype} {n}^3")
    # Spot-check correctness of one row against float64.
    a, b = ins[(iters - 1) % sets]
    ref = a[:1].double() @ b.double()
    err = ((c[:1].double() - ref).abs().max() / ref.abs().max()).item()
    med = statistics.median(times)
    flops = 2.0 * n ** 3
    return dict(dtype=str(dtype).replace("torch.", ""), tf32=tf32, n=n, iters=iters, sets=sets,
                median_ms=med * 1e3, min_ms=min(times) * 1e3, tflops_median=flops / med / 1e12,
                tflops_best=flops / min(times) / 1e12, row0_rel_err=err)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("FATAL: torch.cuda.is_available() is False; this script needs an NVIDIA GPU")
    dev = torch.cuda.get_device_name(0)
    log(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, device {dev}")
    results = []
    for n, dt, tf32 in ((8192, torch.bfloat16, False), (4096, torch.float32, False), (4096, torch.float32, True)):
        log(f"timing {dt} {n}^3 tf32={tf32} ...")
        r = bench(n, dt, args.iters, args.sets, args.warmup, tf32)
        log(f"  {r['tflops_median']:.1f} TFLOP/s median")
        results.append(r)
    print(json.dumps(dict(peer="torch_gemm", device=dev, torch=torch.__version__, cuda=torch.version.cuda,
                          python=platform.python_version(), results=results), indent=2))


if __name__ == "__main__":
    main()
