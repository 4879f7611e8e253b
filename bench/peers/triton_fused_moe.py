#!/usr/bin/env python3
# Vendored unchanged (but for this line) from the workplace's shared/peers/triton_fused_moe.py, 2026-12-02; sha256 of the original: 6ef80f40ec3b586e.
"""Anchor timings for one MoE layer: vLLM's fused-MoE Triton path, rebuilt standalone.

Needs only the Python standard library, torch and triton (no vllm, no network).
bf16 weights ~ N(0, 0.02^2), bf16 inputs ~ N(0, 1). The layer shape and routing come
from --preset (default deepseek-v2-lite; E routed experts, top-K, expert width I):
  deepseek-v2-lite  H=2048 E=64  K=6 I=1408; two shared experts run as one MLP of width
                    2816; softmax top-6, no renormalisation.
  qwen1.5-moe       H=2048 E=60  K=4 I=1408; shared expert of width 5632 with Qwen2-MoE's
                    sigmoid gate: out += sigmoid(x @ w_sg^T) * shared(x), w_sg [1, H];
                    softmax top-4, no renormalisation.
  qwen3-30b-a3b     H=2048 E=128 K=8 I=768; no shared expert (graph_dual_us is null);
                    softmax top-8, top-k weights renormalised (norm_topk_prob=True).
  deepseek-v3       H=7168 E=256 K=8 I=2048; one shared expert of width 2048; DeepSeek-V3
                    noaux_tc routing: s = sigmoid(logits) (fp32), b = s + e_score_correction_bias
                    (fp32 [E], ~N(0, 0.02^2)); group score = sum of the 2 largest b in each of
                    8 groups of 32; keep the 4 best groups; top-8 b among their experts;
                    weights = s there, renormalised, times routed_scaling_factor 2.5 (applied
                    to the fp32 top-k weights, as vLLM's grouped_topk does).
                    One weight set is 22.5 GB here, so --sets defaults to 2 for this preset.

The routed path follows vLLM's Triton fused-MoE design step by step (written anew
here; vLLM's CUDA helper ops are replaced by small Triton kernels):
  gate     x @ wg^T in bf16 (cuBLAS), as vLLM's ReplicatedLinear gate does.
  router   one Triton kernel, fp32 math, fp32 weights, int32 ids. Softmax presets:
           softmax + top-K (+ renormalisation) (vLLM: its CUDA topk_softmax op).
           deepseek-v3: sigmoid + bias + grouped top-K + renorm + scale in one Triton
           kernel (vLLM: its CUDA grouped_topk op); a torch-ops version of the same routing
           (about a dozen small kernels) runs instead with --router torch or if the Triton kernel
           fails its preflight. Every row's "router" field says which ran.
  align    moe_align_block_size: count (token, slot) pairs per expert, pad every
           expert's segment to BLOCK_SIZE_M, scatter the flat pair ids into that
           padded order (padding id = T*K), one expert id per BLOCK_SIZE_M rows,
           total padded length in a 1-element tensor (vLLM: a CUDA op; here a
           memset + 3 small Triton kernels; order inside a segment comes from
           atomics, as in vLLM's CUDA op).
  w13      grouped GEMM kernel: each program owns BLOCK_SIZE_M sorted rows, reads
           that block's expert id, gathers A rows as pair_id // top_k, multiplies by
           w13[expert] ([E, 2I, H], gate rows then up rows), writes cache1[pair, 2I].
           Blocks past the padded total exit at once; for T < BLOCK_SIZE_M the grid
           is cut to T*top_k*BLOCK_SIZE_M rows, as vLLM does.
  act      silu(gate) * up -> cache2[pair, I] (vLLM: CUDA silu_and_mul).
  w2       the same kernel with top_k=1 and MUL_ROUTED_WEIGHT: fp32 accumulator
           times the pair's fp32 routing weight, cast to bf16 -> cache3[pair, H]
           (cache1 and cache3 share one buffer, as in vLLM).
  reduce   sum over the K slots (torch.sum, which is what vLLM's moe_sum does for
           top_k > 4; for top_k <= 4 vLLM has its own small CUDA kernel).
  shared   x @ ws13^T -> silu_and_mul -> @ ws2^T (torch matmuls; qwen1.5-moe also
           multiplies by sigmoid(x @ w_sg^T)), added to the routed output; on the same
           stream, or on a side stream ("dual"). qwen3-30b-a3b has none.

Tile configs (no autotuning: a small fixed set, so compile time stays short):
  default  vLLM's get_default_config() bf16 ladder, as rewritten by vllm-project/vllm
           PR #34846 (merged 2026-02): what vLLM runs for a shape with no tuned file.
           vLLM ships no tuned file for E=64,N=1408 on H200 or H100 (only NVIDIA_B200),
           so this is what vLLM runs for DeepSeek-V2-Lite on an H200.
  tuned    the tuned table E=64,N=1408,device_name=NVIDIA_H100_80GB_HBM3.json, found
           only in the fork zyongye/vllm (commit 4ca1d9292af4); its 28 entries are
           embedded below (same values, one line each); picked with vLLM's
           nearest-batch-size rule. For E=128, I=768 (qwen3-30b-a3b) the tuned table is
           vLLM's own E=128,N=768,device_name=NVIDIA_H200.json. Other presets run
           "default" alone, and an explicit "tuned" is dropped with a note.
  old_default  vLLM's pre-2026 default (not run unless asked).
Both GEMMs of a layer use the same config, as in vLLM.

Helper stages (router, align, act) are tried first on small random data; one whose
Triton kernel fails falls back to torch and every row then says impl=torch-fallback:...
The grouped GEMM has no fallback: it is what is being measured.

Per token count T: a self-check against a float64 per-expert reference (routing
weights and ids checked separately against the preset's routing recomputed in float64
from the same logits, tie-robust; alignment checked structurally; caches poisoned with
NaN first), then CUDA-event timings, median of ITERS after WARMUP, rotating over
--sets weight/input sets (default 3; 2 for deepseek-v3) so L2 holds nothing:
  eager_us        the whole layer, eager, one stream
  graph_us        CUDA-graph replay of the whole layer (gate, router, align, both
                  GEMMs, act, reduce, shared, add), one stream
  graph_dual_us   the same with the shared expert on a side stream (null: no shared expert)
  graph_tuned_us  graph replay, one stream, with the tuned table (deepseek-v2-lite, qwen3-30b-a3b)
  floor_us        (distinct experts touched * 3*H*I*2 + 3*H*IS*2 + gate bytes) bytes
                  / 4.2e12 B/s (experts touched: mean over the weight sets; IS = shared
                  width; gate bytes = E*H*2 (+ H*2 shared gate, + E*4 bias))
  rel_err         max(relative Frobenius error of the routed part alone, of the whole
                  layer) vs float64; the shared expert dominates the layer output, so
                  the routed part is checked on its own. >= 2e-2 (or NaN) prints FAIL.
  ok              the primary config passed its checks and every timing ran
One JSON line per T (each with "preset" and "router"), then a summary table.
$OUT/triton_moe_anchor.json if OUT is set.

Usage:
  PYTHONUNBUFFERED=1 python3 triton_fused_moe.py [--preset deepseek-v3] [--tokens 1,8,64]
        [--configs default,tuned] [--sets 1] [--router auto|torch]
  python3 triton_fused_moe.py --cpu-selftest     # pure-torch parts only: no GPU, no Triton
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    TRITON_IMPORT_ERROR = ""
except Exception as _e:  # the CPU self-test runs without Triton
    triton = None
    tl = None
    HAVE_TRITON = False
    TRITON_IMPORT_ERROR = repr(_e)

# --------------------------------------------------------------------------------------
# Problem constants: one preset's MoE layer (apply_preset sets the globals below)
# --------------------------------------------------------------------------------------
# H hidden size, E routed experts, K experts per token, I moe_intermediate_size,
# IS shared-expert MLP width (0: none), shared_gate: Qwen2-MoE sigmoid gate on the shared
# expert, scoring softmax|sigmoid, grouped: n_group/topk_group group-limited top-k with
# the top-2-sum group score (DeepSeek-V3 noaux_tc, needs e_score_correction_bias),
# renorm: top-k weights divided by their sum, scale: routed_scaling_factor on the weights.
PRESETS = {
    "deepseek-v2-lite": dict(model="DeepSeek-V2-Lite", H=2048, E=64, K=6, I=1408, IS=2816,
                             shared_gate=False, scoring="softmax", n_group=1, topk_group=1,
                             renorm=False, scale=1.0, sets=3),
    "qwen1.5-moe": dict(model="Qwen1.5-MoE-A2.7B", H=2048, E=60, K=4, I=1408, IS=5632,
                        shared_gate=True, scoring="softmax", n_group=1, topk_group=1,
                        renorm=False, scale=1.0, sets=3),
    "qwen3-30b-a3b": dict(model="Qwen3-30B-A3B", H=2048, E=128, K=8, I=768, IS=0,
                          shared_gate=False, scoring="softmax", n_group=1, topk_group=1,
                          renorm=True, scale=1.0, sets=3),
    "deepseek-v3": dict(model="DeepSeek-V3", H=7168, E=256, K=8, I=2048, IS=2048,
                        shared_gate=False, scoring="sigmoid", n_group=8, topk_group=4,
                        renorm=True, scale=2.5, sets=2),
}
DEFAULT_PRESET = "deepseek-v2-lite"
PRESET: dict = {}
H = E = TOPK = I = IS = 0


def apply_preset(name: str, **override) -> dict:
    """Make preset `name` (with any field overridden, e.g. tiny shapes for the self-test)
    the current one: sets PRESET and the shape globals H, E, TOPK, I, IS."""
    global PRESET, H, E, TOPK, I, IS
    p = dict(PRESETS[name])
    p.update(override)
    p["name"] = name
    assert p["E"] % p["n_group"] == 0 and p["topk_group"] <= p["n_group"]
    if p["scoring"] == "sigmoid":
        assert p["n_group"] > 1, "sigmoid scoring is only implemented with grouped top-k"
    PRESET = p
    H, E, TOPK, I, IS = p["H"], p["E"], p["K"], p["I"], p["IS"]
    return p


def has_bias() -> bool:
    return PRESET["scoring"] == "sigmoid"


def shape_str() -> str:
    p = PRESET
    return "H=%d E=%d top-%d I=%d shared %s" % (
        H, E, TOPK, I, ("none" if not IS else "%d%s" % (IS, " sigmoid-gated" if p["shared_gate"] else "")))


apply_preset(DEFAULT_PRESET)
W_STD = 0.02
DTYPE = torch.bfloat16
DEFAULT_TOKENS = (1, 8, 64, 256, 1024, 4096)
HBM_BYTES_PER_S = 4.2e12   # floor bandwidth given in the brief (H200 copy measured ~4.3e12 here)
BF16_FLOPS_PER_S = 790e12  # bf16 cuBLAS rate seen on this workplace's H200 (compute floor, context)
REL_TOL = 2e-2
DEVICE = "cuda"

# --------------------------------------------------------------------------------------
# Tile configs
# --------------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def vllm_default_config(M: int, num_experts: int | None = None) -> dict:
    """vLLM get_default_config(), bf16/fp16 branch, after PR #34846 (2026-02).

    M is the token count (vLLM: min(num_tokens, VLLM_FUSED_MOE_CHUNK_SIZE)); num_experts
    defaults to the current preset's E.
    """
    num_experts = E if num_experts is None else num_experts
    if M <= 32:
        bm = 16
    elif M <= 96:
        bm = 32
    elif M <= 512:
        bm = 64
    else:
        bm = 128
    return {
        "BLOCK_SIZE_M": bm,
        "BLOCK_SIZE_N": 64 if M <= 64 else 128,
        "BLOCK_SIZE_K": 128 if M <= 64 else 64,
        "GROUP_SIZE_M": 16 if M // max(num_experts, 1) > 128 else 1,
        "num_warps": 4 if M <= 128 else 8,
        "num_stages": 4 if M <= 32 else 3,
    }


def vllm_old_default_config(M: int, num_experts: int | None = None) -> dict:
    """vLLM's default before PR #34846 (num_warps/num_stages were Triton's 4/3)."""
    num_experts = E if num_experts is None else num_experts
    if M <= num_experts:
        c = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    else:
        c = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}
    c.update(num_warps=4, num_stages=3)
    return c


# E=64,N=1408,device_name=NVIDIA_H100_80GB_HBM3.json (zyongye/vllm @ 4ca1d9292af452555f8dd2e0a74c00fc31a55817,
# vllm/model_executor/layers/fused_moe/configs/). Upstream vLLM ships E=64,N=1408 only for NVIDIA_B200.
_TUNED_H100_E64_N1408_JSON = """
{
 "1":     {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 32,  "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 4},
 "2":     {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 32,  "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 4},
 "4":     {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 2},
 "8":     {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 32,  "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 5},
 "16":    {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 32,  "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 2},
 "24":    {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 32,  "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 64, "num_warps": 4, "num_stages": 4},
 "32":    {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 32,  "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 5},
 "48":    {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 64,  "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 3},
 "64":    {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 4},
 "96":    {"BLOCK_SIZE_M": 16,  "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 2},
 "128":   {"BLOCK_SIZE_M": 32,  "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 3},
 "256":   {"BLOCK_SIZE_M": 64,  "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 3},
 "512":   {"BLOCK_SIZE_M": 64,  "BLOCK_SIZE_N": 64,  "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 3},
 "1024":  {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 3},
 "1536":  {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 4},
 "2048":  {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 4},
 "3072":  {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 4},
 "4096":  {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 2},
 "6144":  {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 4},
 "8192":  {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 4},
 "10240": {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 4},
 "12288": {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 4},
 "14336": {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 4},
 "16384": {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 4},
 "20480": {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 3},
 "24576": {"BLOCK_SIZE_M": 256, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 8, "num_stages": 2},
 "28672": {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 3},
 "32768": {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64,  "GROUP_SIZE_M": 16, "num_warps": 8, "num_stages": 4}
}
"""
TUNED_TABLE = {int(k): v for k, v in json.loads(_TUNED_H100_E64_N1408_JSON).items()}

# E=128,N=768,device_name=NVIDIA_H200.json (vllm-project/vllm @ 4652ef5d87ed, same folder): the
# table vLLM itself runs for Qwen3-30B-A3B (TP1) on an H200.
_TUNED_H200_E128_N768 = {
    1: (16, 64, 64, 1, 4, 5), 2: (16, 64, 64, 1, 4, 4), 4: (16, 64, 128, 16, 4, 2),
    8: (16, 64, 128, 1, 4, 3), 16: (16, 64, 256, 1, 4, 2), 24: (16, 64, 128, 1, 4, 4),
    32: (16, 64, 128, 16, 4, 2), 48: (16, 128, 128, 16, 4, 3), 64: (16, 256, 128, 1, 8, 2),
    96: (16, 128, 128, 1, 4, 2), 128: (16, 128, 128, 1, 4, 2), 256: (32, 256, 128, 16, 4, 2),
    512: (64, 128, 64, 1, 4, 3), 1024: (128, 256, 64, 16, 8, 4), 1536: (128, 256, 64, 1, 8, 4),
    2048: (128, 256, 64, 1, 8, 4), 3072: (128, 256, 64, 1, 8, 4), 4096: (128, 256, 64, 16, 8, 4)}
_CFG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
# (E, N=I) -> {batch size: config}: the tuned tables embedded here.
TUNED_TABLES = {(64, 1408): TUNED_TABLE,
                (128, 768): {m: dict(zip(_CFG_KEYS, v)) for m, v in _TUNED_H200_E128_N768.items()}}
TUNED_SHAPE = (64, 1408)  # the deepseek-v2-lite table (kept for the self-test)


def tuned_config(M: int, num_experts: int | None = None) -> dict:
    # vLLM try_get_optimal_moe_config: the entry whose batch size is nearest to M
    num_experts = E if num_experts is None else num_experts
    table = TUNED_TABLES.get((num_experts, I))
    if table is None:
        raise ValueError("no tuned table for E=%d,N=%d (only %s)" % (num_experts, I, sorted(TUNED_TABLES)))
    key = min(table.keys(), key=lambda k: abs(k - M))
    return dict(table[key])


CONFIG_SOURCES = {
    "default": vllm_default_config,
    "tuned": tuned_config,
    "old_default": vllm_old_default_config,
}


def config_unavailable(name: str) -> str:
    """'' if config source `name` applies to the current preset's shape, else why not."""
    if name == "tuned" and (E, I) not in TUNED_TABLES:
        return "no tuned table for E=%d,N=%d (embedded: %s)" % (E, I, sorted(TUNED_TABLES))
    return ""


def cfg_str(c: dict) -> str:
    return "M{}/N{}/K{}/G{}/w{}/s{}".format(
        c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], c["GROUP_SIZE_M"],
        c["num_warps"], c["num_stages"])


# Which implementation each helper stage uses. The preflight switches a stage to its
# torch fallback (and says so in every output row) if its Triton kernel fails.
# ROUTER_CHOICE "torch" (--router torch) runs the torch router by choice, not as a fallback.
IMPL = {"router": "triton", "align": "triton", "act": "triton"}
ROUTER_CHOICE = "auto"

# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit(do_not_specialize=["EM", "num_valid"])
    def _moe_gemm_kernel(
        a_ptr, b_ptr, c_ptr, topk_w_ptr,
        sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
        N, K, EM, num_valid,
        stride_am, stride_ak,
        stride_be, stride_bn, stride_bk,
        stride_cm, stride_cn,
        TOP_K: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr,
        BLOCK_SIZE_N: tl.constexpr,
        BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr,
    ):
        """C[pair, :] = A[pair // TOP_K, :] @ B[expert(pair)]^T (* routing weight).

        A: [rows, K]; B: [E, N, K]; C: [pairs, N]. Rows of the sorted, padded pair
        list are processed BLOCK_SIZE_M at a time; every such block belongs to one
        expert (expert_ids[block]). Padding entries hold num_valid and are masked.
        """
        pid = tl.program_id(axis=0)
        # grouped launch order (GROUP_SIZE_M row blocks share each weight tile in L2)
        num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
        num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
        pids_per_group = GROUP_SIZE_M * num_pid_n
        group = pid // pids_per_group
        first_m = group * GROUP_SIZE_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_SIZE_M)
        pid_m = first_m + ((pid % pids_per_group) % group_rows)
        pid_n = (pid % pids_per_group) // group_rows

        total = tl.load(num_post_pad_ptr)
        if pid_m * BLOCK_SIZE_M >= total:
            return  # past the padded end: nothing to do

        rows = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
        pair = tl.load(sorted_ids_ptr + rows).to(tl.int64)
        pair_ok = pair < num_valid
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

        offs_n = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        a_ptrs = a_ptr + (pair[:, None] // TOP_K) * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            k_left = K - kb * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=pair_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc=acc)
            a_ptrs += BLOCK_SIZE_K * stride_ak
            b_ptrs += BLOCK_SIZE_K * stride_bk

        if MUL_ROUTED_WEIGHT:
            w = tl.load(topk_w_ptr + pair, mask=pair_ok, other=0.0)
            acc = acc * w[:, None]

        out = acc.to(c_ptr.dtype.element_ty)
        offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_cn[None, :] * stride_cn
        tl.store(c_ptrs, out, mask=pair_ok[:, None] & (offs_cn[None, :] < N))

    @triton.jit(do_not_specialize=["T"])
    def _router_kernel(
        logits_ptr, w_ptr, ids_ptr, T, stride_lt,
        NE: tl.constexpr, NE_PAD: tl.constexpr, TOP: tl.constexpr, ROWS: tl.constexpr,
        RENORM: tl.constexpr,
    ):
        """softmax over NE logits (fp32) then the TOP largest: weights fp32, ids int32.

        RENORM: the TOP weights are divided by their sum (a first pass finds the sum)."""
        pid = tl.program_id(axis=0)
        r = pid * ROWS + tl.arange(0, ROWS)
        r_ok = r < T
        cols = tl.arange(0, NE_PAD)
        c_ok = cols < NE
        x = tl.load(logits_ptr + r[:, None] * stride_lt + cols[None, :],
                    mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        x = tl.where(c_ok[None, :], x, float("-inf"))
        mx = tl.max(x, axis=1)
        p = tl.exp(x - mx[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        if RENORM:
            q = p
            tot = tl.zeros((ROWS,), dtype=tl.float32)
            for j in tl.static_range(TOP):
                best = tl.max(q, axis=1)
                idx = tl.min(tl.where(q == best[:, None], cols[None, :], NE_PAD), axis=1)
                tot += best
                q = tl.where(cols[None, :] == idx[:, None], -1.0, q)
        for j in tl.static_range(TOP):
            best = tl.max(p, axis=1)
            idx = tl.min(tl.where(p == best[:, None], cols[None, :], NE_PAD), axis=1)
            if RENORM:
                tl.store(w_ptr + r * TOP + j, best / tot, mask=r_ok)
            else:
                tl.store(w_ptr + r * TOP + j, best, mask=r_ok)
            tl.store(ids_ptr + r * TOP + j, idx.to(tl.int32), mask=r_ok)
            p = tl.where(cols[None, :] == idx[:, None], -1.0, p)

    @triton.jit(do_not_specialize=["T"])
    def _router_grouped_kernel(
        logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_lt, scale,
        NE: tl.constexpr, NG: tl.constexpr, TG: tl.constexpr, TOP: tl.constexpr,
        ROWS: tl.constexpr, RENORM: tl.constexpr,
    ):
        """DeepSeek-V3 noaux_tc routing, fp32 (NE a power of 2, NG groups of NE // NG):
        s = sigmoid(logit), b = s + bias; group score = sum of the 2 largest b of the
        group; keep the TG best groups; the TOP largest b among their experts (ties: the
        lowest index); weight = s there (/ sum of the TOP s if RENORM) * scale."""
        EPG: tl.constexpr = NE // NG
        pid = tl.program_id(axis=0)
        r = pid * ROWS + tl.arange(0, ROWS)
        r_ok = r < T
        cols = tl.arange(0, NE)
        x = tl.load(logits_ptr + r[:, None] * stride_lt + cols[None, :],
                    mask=r_ok[:, None], other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-x))
        b = s + tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        grp = cols // EPG
        gcols = tl.arange(0, NG)
        gscore = tl.zeros((ROWS, NG), dtype=tl.float32)
        for g in tl.static_range(NG):
            bg = tl.where((grp == g)[None, :], b, float("-inf"))
            m1 = tl.max(bg, axis=1)
            i1 = tl.min(tl.where(bg == m1[:, None], cols[None, :], NE), axis=1)
            m2 = tl.max(tl.where(cols[None, :] == i1[:, None], float("-inf"), bg), axis=1)
            gscore = tl.where(gcols[None, :] == g, (m1 + m2)[:, None], gscore)
        keep = tl.zeros((ROWS, NE), dtype=tl.int32)
        for j in tl.static_range(TG):
            gbest = tl.max(gscore, axis=1)
            gi = tl.min(tl.where(gscore == gbest[:, None], gcols[None, :], NG), axis=1)
            keep = tl.where(grp[None, :] == gi[:, None], 1, keep)
            gscore = tl.where(gcols[None, :] == gi[:, None], float("-inf"), gscore)
        sel = tl.where(keep != 0, b, float("-inf"))
        if RENORM:
            q = sel
            tot = tl.zeros((ROWS,), dtype=tl.float32)
            for j in tl.static_range(TOP):
                best = tl.max(q, axis=1)
                idx = tl.min(tl.where(q == best[:, None], cols[None, :], NE), axis=1)
                tot += tl.sum(tl.where(cols[None, :] == idx[:, None], s, 0.0), axis=1)
                q = tl.where(cols[None, :] == idx[:, None], float("-inf"), q)
            mult = scale / tot
        else:
            mult = tl.zeros((ROWS,), dtype=tl.float32) + scale
        for j in tl.static_range(TOP):
            best = tl.max(sel, axis=1)
            idx = tl.min(tl.where(sel == best[:, None], cols[None, :], NE), axis=1)
            wj = tl.sum(tl.where(cols[None, :] == idx[:, None], s, 0.0), axis=1)
            tl.store(w_ptr + r * TOP + j, wj * mult, mask=r_ok)
            tl.store(ids_ptr + r * TOP + j, idx.to(tl.int32), mask=r_ok)
            sel = tl.where(cols[None, :] == idx[:, None], float("-inf"), sel)

    @triton.jit(do_not_specialize=["numel"])
    def _align_count_kernel(ids_ptr, counts_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        e = tl.load(ids_ptr + offs, mask=ok, other=0)
        tl.atomic_add(counts_ptr + e, 1, mask=ok)

    @triton.jit(do_not_specialize=["numel", "max_padded", "max_blocks"])
    def _align_offsets_kernel(
        counts_ptr, cursor_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
        numel, max_padded, max_blocks,
        NE: tl.constexpr, NE_PAD: tl.constexpr, BM: tl.constexpr,
        FILL_BLOCK: tl.constexpr, EXP_BLOCK: tl.constexpr,
    ):
        """One program: padded segment starts, total, expert id per BM rows, padding fill."""
        e_offs = tl.arange(0, NE_PAD)
        e_ok = e_offs < NE
        cnt = tl.load(counts_ptr + e_offs, mask=e_ok, other=0)
        padded = (cnt + (BM - 1)) // BM * BM
        seg_end = tl.cumsum(padded, axis=0)
        seg_start = seg_end - padded
        total = tl.sum(padded, axis=0)
        tl.store(cursor_ptr + e_offs, seg_start, mask=e_ok)
        tl.store(num_post_pad_ptr, total)
        # the expert of block b is the number of experts whose segment ends at or before b*BM
        for b0 in range(0, max_blocks, EXP_BLOCK):
            b = b0 + tl.arange(0, EXP_BLOCK)
            row0 = b * BM
            before = (seg_end[None, :] <= row0[:, None]) & e_ok[None, :]
            eid = tl.sum(before.to(tl.int32), axis=1)
            eid = tl.where(row0 < total, eid, -1)
            tl.store(expert_ids_ptr + b, eid, mask=b < max_blocks)
        pad_val = tl.zeros([FILL_BLOCK], dtype=tl.int32) + numel
        for p0 in range(0, max_padded, FILL_BLOCK):
            p = p0 + tl.arange(0, FILL_BLOCK)
            tl.store(sorted_ids_ptr + p, pad_val, mask=p < max_padded)

    @triton.jit(do_not_specialize=["numel"])
    def _align_scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        e = tl.load(ids_ptr + offs, mask=ok, other=0)
        slot = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
        tl.store(sorted_ids_ptr + slot, offs, mask=ok)

    @triton.jit
    def _silu_mul_kernel(in_ptr, out_ptr, D, stride_in, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(axis=0).to(tl.int64)
        cols = tl.program_id(axis=1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < D
        g = tl.load(in_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(in_ptr + row * stride_in + D + cols, mask=ok, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------
# Stage wrappers (Triton, with pure-torch fallbacks that are also CUDA-graph safe)
# --------------------------------------------------------------------------------------


def route_torch(logits: torch.Tensor, bias: torch.Tensor | None = None):
    """The current preset's routing in torch ops (fp32): (weights fp32 [T, K], ids int32 [T, K])."""
    p = PRESET
    if p["scoring"] == "softmax":
        sc = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(sc, TOPK, dim=-1)
    else:  # DeepSeek-V3 noaux_tc: sigmoid + bias, group-limited top-k (as vLLM's grouped_topk)
        T = logits.shape[0]
        sc = logits.float().sigmoid()
        b = (sc + bias.float()[None, :]).view(T, p["n_group"], -1)
        gscore = b.topk(2, dim=-1).values.sum(dim=-1)
        gidx = gscore.topk(p["topk_group"], dim=-1).indices
        gmask = torch.zeros_like(gscore).scatter_(1, gidx, 1.0)
        sel = b.masked_fill(gmask[:, :, None] == 0, float("-inf")).view(T, -1)
        ids = sel.topk(TOPK, dim=-1).indices
        w = sc.gather(1, ids)
    if p["renorm"]:
        w = w / w.sum(dim=-1, keepdim=True)
    if p["scale"] != 1.0:
        w = w * p["scale"]
    return w.contiguous(), ids.to(torch.int32).contiguous()


def route_triton(logits: torch.Tensor, bias: torch.Tensor | None = None):
    assert logits.stride(1) == 1
    p = PRESET
    T, ne = logits.shape
    w = torch.empty(T, TOPK, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, TOPK, dtype=torch.int32, device=logits.device)
    rows = 16
    if p["scoring"] == "softmax":
        assert p["scale"] == 1.0, "the softmax router kernel has no routed scaling"
        _router_kernel[(cdiv(T, rows),)](
            logits, w, ids, T, logits.stride(0),
            NE=ne, NE_PAD=triton.next_power_of_2(ne), TOP=TOPK, ROWS=rows,
            RENORM=bool(p["renorm"]), num_warps=4)
    else:
        assert ne == triton.next_power_of_2(ne) and ne % p["n_group"] == 0
        assert bias is not None and bias.dtype == torch.float32 and bias.is_contiguous()
        _router_grouped_kernel[(cdiv(T, rows),)](
            logits, bias, w, ids, T, logits.stride(0), float(p["scale"]),
            NE=ne, NG=p["n_group"], TG=p["topk_group"], TOP=TOPK, ROWS=rows,
            RENORM=bool(p["renorm"]), num_warps=4)
    return w, ids


def route(logits: torch.Tensor, bias: torch.Tensor | None = None):
    if IMPL["router"] == "triton":
        return route_triton(logits, bias)
    return route_torch(logits, bias)


def router_desc() -> str:
    """Which router implementation runs now, and what it computes."""
    p = PRESET
    if p["scoring"] == "softmax":
        what = "softmax(fp32) + top-%d%s" % (TOPK, " + renorm" if p["renorm"] else "")
    else:
        what = "sigmoid(fp32) + bias, grouped top-%d (%d groups, top-2-sum score, keep %d)%s%s" % (
            TOPK, p["n_group"], p["topk_group"], " + renorm" if p["renorm"] else "",
            " x%g" % p["scale"] if p["scale"] != 1.0 else "")
    if IMPL["router"] == "triton":
        return "triton kernel: " + what
    why = "chosen by --router torch" if ROUTER_CHOICE == "torch" else "FALLBACK after the Triton kernel failed"
    return "torch ops (%s): %s" % (why, what)


def align_sizes(numel: int, bm: int, num_experts: int):
    """Buffer sizes exactly as vLLM's moe_align_block_size allocates them."""
    max_padded = numel + num_experts * (bm - 1)
    if numel < num_experts:
        max_padded = min(numel * bm, max_padded)
    return max_padded, cdiv(max_padded, bm)


def align_torch(topk_ids: torch.Tensor, bm: int, num_experts: int):
    """Reference moe_align_block_size in torch: stable order within an expert, no host sync."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    max_padded, max_blocks = align_sizes(numel, bm, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (bm - 1)) // bm * bm
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    dest = seg_start[e_sorted] + (torch.arange(numel, device=dev) - cnt_start[e_sorted])
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    total = seg_end[-1:]
    row0 = torch.arange(max_blocks, device=dev) * bm
    eid = torch.searchsorted(seg_end, row0, right=True)
    expert_ids = torch.where(row0 < total, eid, torch.full_like(eid, -1)).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


def align_triton(topk_ids: torch.Tensor, bm: int, num_experts: int):
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous()
    dev = topk_ids.device
    numel = topk_ids.numel()
    max_padded, max_blocks = align_sizes(numel, bm, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    ntp = torch.empty(1, dtype=torch.int32, device=dev)
    blk = 1024
    grid = (cdiv(numel, blk),)
    _align_count_kernel[grid](topk_ids, counts, numel, BLOCK=blk, num_warps=4)
    _align_offsets_kernel[(1,)](
        counts, cursor, sorted_ids, expert_ids, ntp, numel, max_padded, max_blocks,
        NE=num_experts, NE_PAD=triton.next_power_of_2(num_experts), BM=bm,
        FILL_BLOCK=2048, EXP_BLOCK=64, num_warps=4)
    _align_scatter_kernel[grid](topk_ids, cursor, sorted_ids, numel, BLOCK=blk, num_warps=4)
    return sorted_ids, expert_ids, ntp


def align(topk_ids: torch.Tensor, bm: int, num_experts: int):
    if IMPL["align"] == "triton":
        return align_triton(topk_ids, bm, num_experts)
    return align_torch(topk_ids, bm, num_experts)


def silu_and_mul_triton(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    assert inp.stride(1) == 1 and out.stride(1) == 1
    d = inp.shape[1] // 2
    blk = 1024
    _silu_mul_kernel[(inp.shape[0], cdiv(d, blk))](
        inp, out, d, inp.stride(0), out.stride(0), BLOCK=blk, num_warps=4)
    return out


def silu_and_mul_torch(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    d = inp.shape[1] // 2
    return torch.mul(F.silu(inp[:, :d]), inp[:, d:], out=out)


def silu_and_mul(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if IMPL["act"] == "triton":
        return silu_and_mul_triton(inp, out)
    return silu_and_mul_torch(inp, out)


def moe_gemm(A, B, C, topk_w, sorted_ids, expert_ids, ntp, top_k, mul_routed_weight, cfg):
    """vLLM invoke_fused_moe_kernel, bf16 only. A [rows, K], B [E, N, K], C [rows*top_k, N]."""
    assert A.stride(1) == 1 and B.stride(2) == 1 and C.stride(1) == 1
    assert B.shape[2] == A.shape[1] and C.shape[1] == B.shape[1]
    bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
    em = sorted_ids.shape[0]
    if A.shape[0] < bm:  # small batch: at most rows*top_k non-empty blocks
        em = min(em, A.shape[0] * top_k * bm)
    n, k = B.shape[1], B.shape[2]
    grid = (cdiv(em, bm) * cdiv(n, bn),)
    _moe_gemm_kernel[grid](
        A, B, C, topk_w, sorted_ids, expert_ids, ntp,
        n, k, em, A.shape[0] * top_k,
        A.stride(0), A.stride(1),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1),
        TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"],
        GROUP_SIZE_M=cfg["GROUP_SIZE_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


# --------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------


def routed_experts(x, W, cfg, poison=False, dbg=None, gemm=None):
    """vLLM fused_experts_impl (one chunk): router -> align -> w13 -> act -> w2 -> sum."""
    gemm = gemm or moe_gemm
    T = x.shape[0]
    ne, two_i, hid = W["w13"].shape
    inter = two_i // 2
    logits = torch.mm(x, W["wg"].t())
    topk_w, topk_ids = route(logits, W.get("bias"))
    sorted_ids, expert_ids, ntp = align(topk_ids, cfg["BLOCK_SIZE_M"], ne)
    pairs = T * TOPK
    cache13 = torch.empty(pairs * max(two_i, hid), device=x.device, dtype=x.dtype)
    cache1 = cache13[: pairs * two_i].view(pairs, two_i)
    cache3 = cache13[: pairs * hid].view(pairs, hid)
    cache2 = torch.empty(pairs, inter, device=x.device, dtype=x.dtype)
    if poison:  # unwritten rows then show up as NaN in the output
        cache13.fill_(float("nan"))
        cache2.fill_(float("nan"))
    gemm(x, W["w13"], cache1, topk_w, sorted_ids, expert_ids, ntp, TOPK, False, cfg)
    silu_and_mul(cache1, cache2)
    gemm(cache2, W["w2"], cache3, topk_w, sorted_ids, expert_ids, ntp, 1, True, cfg)
    out = cache3.view(T, TOPK, hid).sum(dim=1)
    if dbg is not None:
        dbg.update(logits=logits, topk_w=topk_w, topk_ids=topk_ids, sorted_ids=sorted_ids,
                   expert_ids=expert_ids, ntp=ntp)
    return out


def shared_experts(x, W):
    h = torch.mm(x, W["ws13"].t())
    a = torch.empty(x.shape[0], W["ws2"].shape[1], device=x.device, dtype=x.dtype)
    silu_and_mul(h, a)
    s = torch.mm(a, W["ws2"].t())
    if "wsg" in W:  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x), in bf16
        s.mul_(torch.sigmoid(torch.mm(x, W["wsg"].t())))
    return s


def moe_layer(x, W, cfg, dual=False, side=None, poison=False, dbg=None, gemm=None):
    if "ws13" not in W:  # no shared expert (dual is then the same as single-stream)
        r = routed_experts(x, W, cfg, poison, dbg, gemm)
        if dbg is not None:
            dbg.update(routed=r.clone(), shared=torch.zeros_like(r))
        return r
    if not dual:
        s = shared_experts(x, W)
        r = routed_experts(x, W, cfg, poison, dbg, gemm)
    else:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            s = shared_experts(x, W)
        r = routed_experts(x, W, cfg, poison, dbg, gemm)
        main.wait_stream(side)
        if not torch.cuda.is_current_stream_capturing():
            s.record_stream(main)
    if dbg is not None:
        dbg.update(routed=r.clone(), shared=s.clone())
    r.add_(s)
    return r


# --------------------------------------------------------------------------------------
# References and checks
# --------------------------------------------------------------------------------------


def reference_layer(x, W, topk_ids, topk_w):
    """float64 per-expert loop for the given routing; returns (routed, shared)."""
    xd = x.double()
    T = x.shape[0]
    top = topk_ids.shape[1]
    inter = W["w2"].shape[2]
    ids = topk_ids.reshape(-1).long()
    wts = topk_w.reshape(-1).double()
    tok = torch.arange(T, device=x.device).repeat_interleave(top)
    routed = torch.zeros(T, W["w2"].shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        sel = (ids == e).nonzero(as_tuple=True)[0]
        t = tok[sel]
        h = xd[t] @ W["w13"][e].double().t()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = a @ W["w2"][e].double().t()
        routed.index_add_(0, t, y * wts[sel, None])
    if "ws13" not in W:
        return routed, torch.zeros_like(routed)
    inter_s = W["ws2"].shape[1]
    hs = xd @ W["ws13"].double().t()
    shared = (F.silu(hs[:, :inter_s]) * hs[:, inter_s:]) @ W["ws2"].double().t()
    if "wsg" in W:
        shared = shared * torch.sigmoid(xd @ W["wsg"].double().t())
    return routed, shared


def rel_err(got, ref) -> float:
    ref = ref.double()
    d = (got.double() - ref).norm().item()
    n = ref.norm().item()
    return d / n if n > 0 else d


def reference_scores(logits, bias=None):
    """float64 (weight scores, selection scores) of the current preset's router."""
    l = logits.double()
    if PRESET["scoring"] == "softmax":
        p = torch.softmax(l, dim=-1)
        return p, p
    s = torch.sigmoid(l)
    return s, s + bias.double()[None, :]


def reference_weights(logits, topk_ids, bias=None):
    """float64 routing weights of the current preset at the given ids."""
    sc, _ = reference_scores(logits, bias)
    w = sc.gather(1, topk_ids.long())
    if PRESET["renorm"]:
        w = w / w.sum(dim=1, keepdim=True)
    return w * PRESET["scale"]


def check_router(logits, topk_w, topk_ids, num_experts, bias=None):
    """Tie-robust check of one router output against the preset's routing in float64.

    Ids valid and unique per token; weights = the float64 weights at those ids (after
    renormalisation and scaling); no expert left out that beats a chosen one (softmax:
    by more than 1e-6). Grouped top-k: no chosen expert in a group that is surely
    outside the top-`topk_group` groups, at most `topk_group` groups surely kept, and
    no expert of a surely kept group (one holding a chosen expert, or scoring above the
    topk_group-th group score + tol) left out that beats a chosen one by more than tol.
    Returns (ok, message, float64 weights at the chosen ids)."""
    ids = topk_ids.long()
    T = ids.shape[0]
    ref_w = None
    if not bool(((ids >= 0) & (ids < num_experts)).all()):
        return False, "router ids out of range", ref_w
    srt = ids.sort(dim=1).values
    if srt.shape[1] > 1 and bool((srt[:, 1:] == srt[:, :-1]).any()):
        return False, "router ids repeat within a token", ref_w
    ref_w = reference_weights(logits, ids, bias)
    w_err = (ref_w - topk_w.double()).abs().max().item()
    _, selv = reference_scores(logits, bias)
    chosen = selv.gather(1, ids)
    if PRESET["scoring"] == "softmax":
        tol = 1e-6
        rest = selv.scatter(1, ids, -1.0).max(dim=1).values
        gap = (chosen.min(dim=1).values - rest).min().item() if selv.shape[1] > ids.shape[1] else 0.0
        extra = ""
    else:
        tol = 2e-6
        ng, tg = PRESET["n_group"], PRESET["topk_group"]
        epg = num_experts // ng
        gs = selv.view(T, ng, epg).topk(2, dim=-1).values.sum(dim=-1)
        kth = gs.topk(tg, dim=-1).values[:, -1:]
        cg = torch.zeros(T, ng, dtype=torch.bool, device=ids.device)
        cg.scatter_(1, ids // epg, True)
        if bool((cg & (gs < kth - tol)).any()):
            return False, "router chose an expert outside the top-%d groups" % tg, ref_w
        kept = cg | (gs > kth + tol)
        if bool((kept.sum(dim=1) > tg).any()):
            return False, "router used more than %d groups" % tg, ref_w
        allowed = kept[:, :, None].expand(T, ng, epg).reshape(T, num_experts)
        cm = torch.zeros(T, num_experts, dtype=torch.bool, device=ids.device)
        cm.scatter_(1, ids, True)
        rest = selv.masked_fill(~allowed | cm, float("-inf")).max(dim=1).values
        gap = (chosen.min(dim=1).values - rest).min().item()
        extra = ", groups used max %d" % int(cg.sum(dim=1).max().item())
    ok = w_err < 1e-5 and gap >= -tol
    return ok, "router weight err %.2e, top-k margin %.2e%s" % (w_err, gap, extra), ref_w


def check_align(topk_ids, sorted_ids, expert_ids, ntp, bm, num_experts):
    """Structural check of moe_align_block_size output (any order inside a segment)."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    max_padded, max_blocks = align_sizes(numel, bm, num_experts)
    if sorted_ids.numel() != max_padded or expert_ids.numel() != max_blocks:
        return False, "buffer sizes %d/%d, want %d/%d" % (
            sorted_ids.numel(), expert_ids.numel(), max_padded, max_blocks)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    want_total = int(((counts + bm - 1) // bm * bm).sum().item())
    total = int(ntp.reshape(-1)[0].item())
    if total != want_total:
        return False, "padded total %d, want %d" % (total, want_total)
    s = sorted_ids[:total].long()
    valid = s < numel
    if int(valid.sum().item()) != numel:
        return False, "%d valid entries, want %d" % (int(valid.sum().item()), numel)
    if not torch.equal(torch.sort(s[valid]).values, torch.arange(numel, device=s.device)):
        return False, "valid entries are not a permutation of the pairs"
    if bool((s[~valid] != numel).any()):
        return False, "bad padding value inside the padded total"
    blk = torch.arange(total, device=s.device) // bm
    eb = expert_ids[: total // bm].long()
    if bool(((eb < 0) | (eb >= num_experts)).any()):
        return False, "expert id out of range inside the padded total"
    if not torch.equal(flat[s[valid]], eb[blk[valid]]):
        return False, "a pair sits in a block of another expert"
    if total < max_padded and bool((sorted_ids[total:] != numel).any()):
        return False, "tail after the padded total not filled with the padding id"
    if total // bm < max_blocks and bool((expert_ids[total // bm:] >= 0).any()):
        return False, "expert id set for a block past the padded total"
    return True, "align ok (total %d of %d)" % (total, max_padded)


# --------------------------------------------------------------------------------------
# GPU harness
# --------------------------------------------------------------------------------------


def make_weights(device, gen_dtype=DTYPE):
    """One weight set of the current preset: wg [E, H], w13 [E, 2I, H], w2 [E, H, I],
    ws13 [2IS, H] and ws2 [H, IS] if IS, wsg [1, H] if the shared expert is gated,
    bias [E] (fp32, e_score_correction_bias) for sigmoid routing."""
    def rnd(*shape):
        return torch.empty(*shape, device=device, dtype=gen_dtype).normal_(0.0, W_STD)
    W = dict(
        wg=rnd(E, H),
        w13=rnd(E, 2 * I, H),
        w2=rnd(E, H, I),
    )
    if IS:
        W.update(ws13=rnd(2 * IS, H), ws2=rnd(H, IS))
    if PRESET["shared_gate"]:
        W["wsg"] = rnd(1, H)
    if has_bias():
        bdt = torch.float64 if gen_dtype == torch.float64 else torch.float32
        W["bias"] = torch.empty(E, device=device, dtype=bdt).normal_(0.0, W_STD)
    return W


def weight_set_bytes() -> int:
    n = E * H + E * 2 * I * H + E * H * I + 2 * IS * H + H * IS + (H if PRESET["shared_gate"] else 0)
    return n * 2 + (E * 4 if has_bias() else 0)


def time_median_us(fns, warmup, iters):
    """CUDA-event time of each call, cycling over fns; median in microseconds."""
    n = len(fns)
    for i in range(warmup):
        fns[i % n]()
    torch.cuda.synchronize()
    ev0 = torch.cuda.Event(enable_timing=True)
    ev1 = torch.cuda.Event(enable_timing=True)
    ts = []
    for i in range(iters):
        f = fns[i % n]
        ev0.record()
        f()
        ev1.record()
        ev1.synchronize()
        ts.append(ev0.elapsed_time(ev1) * 1e3)
    return statistics.median(ts)


def capture_graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def preflight(device):
    """Try each small Triton kernel on random data; fall back to torch where one fails."""
    notes = []
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    # router (the preset's routing; also the torch version, which is the fallback)
    bias = None
    if has_bias():
        bias = torch.empty(E, device=device, dtype=torch.float32).normal_(0.0, W_STD, generator=gen)
    for T in (37, 300):
        logits = (torch.randn(T, E, device=device, generator=gen) * 1.7).to(DTYPE)
        w, ids = route_torch(logits, bias)
        ok, msg, _ = check_router(logits, w, ids, E, bias)
        notes.append("router: torch version T=%d %s (%s)" % (T, "ok" if ok else "FAILS ITS CHECK", msg))
    if ROUTER_CHOICE == "torch":
        IMPL["router"] = "torch"
        notes.append("router: torch ops by choice (--router torch)")
    else:
        try:
            for T in (37, 300):
                logits = (torch.randn(T, E, device=device, generator=gen) * 1.7).to(DTYPE)
                w, ids = route_triton(logits, bias)
                torch.cuda.synchronize()
                ok, msg, _ = check_router(logits, w, ids, E, bias)
                if not ok:
                    raise RuntimeError("T=%d: %s" % (T, msg))
            notes.append("router: triton ok (%s)" % msg)
        except Exception as e:
            IMPL["router"] = "torch"
            notes.append("router: TRITON FAILED, using torch ops: %s" % repr(e)[:300])
    notes.append("router: " + router_desc())
    # align (ids from torch topk so they are unique per token)
    try:
        for T, bm in ((1, 16), (5, 16), (37, 32), (300, 64), (700, 128)):
            ids = torch.rand(T, E, device=device, generator=gen).topk(TOPK, dim=-1).indices
            ids = ids.to(torch.int32).contiguous()
            out = align_triton(ids, bm, E)
            torch.cuda.synchronize()
            ok, msg = check_align(ids, *out, bm, E)
            if not ok:
                raise RuntimeError("T=%d BM=%d: %s" % (T, bm, msg))
        notes.append("align: triton ok")
    except Exception as e:
        IMPL["align"] = "torch"
        notes.append("align: TRITON FAILED, using torch argsort align: %s" % repr(e)[:300])
    # silu_and_mul
    try:
        inp = torch.randn(13, 2 * 1408, device=device, generator=gen).to(DTYPE)
        out = torch.empty(13, 1408, device=device, dtype=DTYPE)
        silu_and_mul_triton(inp, out)
        torch.cuda.synchronize()
        ref = F.silu(inp[:, :1408].double()) * inp[:, 1408:].double()
        err = rel_err(out, ref)
        if not err < 1e-2:
            raise RuntimeError("rel err %.3e" % err)
        notes.append("act: triton ok (rel err %.1e)" % err)
    except Exception as e:
        IMPL["act"] = "torch"
        notes.append("act: TRITON FAILED, using torch silu*mul: %s" % repr(e)[:300])
    return notes


def impl_tag():
    chosen = ["router"] if (ROUTER_CHOICE == "torch" and IMPL["router"] == "torch") else []
    bad = [k for k, v in IMPL.items() if v != "triton" and k not in chosen]
    tags = (["torch-fallback:" + ",".join(bad)] if bad else []) + (["torch-router(chosen)"] if chosen else [])
    return ";".join(tags) if tags else "all-triton"


def check_layer(x, W, cfg, side, gemm=None):
    """Run the layer once with poisoned caches and compare against float64."""
    dbg = {}
    out = moe_layer(x, W, cfg, dual=False, side=side, poison=True, dbg=dbg, gemm=gemm)
    if x.is_cuda:
        torch.cuda.synchronize()
    msgs = []
    ok_r, msg_r, _ = check_router(dbg["logits"], dbg["topk_w"], dbg["topk_ids"], E, W.get("bias"))
    msgs.append(msg_r)
    ok_a, msg_a = check_align(dbg["topk_ids"], dbg["sorted_ids"], dbg["expert_ids"], dbg["ntp"],
                              cfg["BLOCK_SIZE_M"], E)
    msgs.append(msg_a)
    # float64 weights of the preset's routing at the chosen experts (the ids themselves
    # were checked above); a bad id shows up in check_router, not here
    ref_w = reference_weights(dbg["logits"], dbg["topk_ids"].clamp(0, E - 1), W.get("bias"))
    ref_routed, ref_shared = reference_layer(x, W, dbg["topk_ids"].clamp(0, E - 1), ref_w)
    e_routed = rel_err(dbg["routed"], ref_routed)
    e_total = rel_err(out, ref_routed + ref_shared)
    worst = max(e_routed, e_total)
    if math.isnan(worst) or math.isnan(e_routed) or math.isnan(e_total):
        worst = float("nan")
    ok = ok_r and ok_a and (worst < REL_TOL)  # NaN compares False
    active = int(torch.unique(dbg["topk_ids"]).numel())
    return dict(ok=ok, rel_err=worst, routed_rel_err=e_routed, total_rel_err=e_total,
                router_ok=ok_r, align_ok=ok_a, notes=msgs, active=active, out=out)


def bytes_floor_us(active_experts: float) -> float:
    b = active_experts * 3 * H * I * 2 + 3 * H * IS * 2 + E * H * 2
    if PRESET["shared_gate"]:
        b += H * 2
    if has_bias():
        b += E * 4
    return b / HBM_BYTES_PER_S * 1e6


def compute_floor_us(T: int) -> float:
    flops = 2.0 * T * TOPK * 3 * H * I + 2.0 * T * 3 * H * IS + 2.0 * T * H * E
    if PRESET["shared_gate"]:
        flops += 2.0 * T * H
    return flops / BF16_FLOPS_PER_S * 1e6


def fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return ("%." + str(nd) + "f") % v


def run_tokens(T, sets, cfg_names, side, warmup, iters, device):
    t0 = time.time()
    n = len(sets)
    primary = cfg_names[0]
    cfgs = {name: CONFIG_SOURCES[name](T) for name in cfg_names}
    row = {"tokens": T, "preset": PRESET["name"], "floor_us": None, "eager_us": None, "graph_us": None,
           "graph_dual_us": None, "rel_err": None, "ok": False}
    row["config"] = primary
    row["cfg"] = cfg_str(cfgs[primary])
    row["impl"] = impl_tag()
    row["router"] = router_desc()
    errors = []
    xs = [torch.randn(T, H, device=device, dtype=DTYPE) for _ in range(n)]

    # --- correctness of the primary config on set 0 (this also compiles its kernels) ---
    chk = check_layer(xs[0], sets[0], cfgs[primary], side)
    row.update(rel_err=chk["rel_err"], routed_rel_err=chk["routed_rel_err"],
               total_rel_err=chk["total_rel_err"], router_ok=chk["router_ok"],
               align_ok=chk["align_ok"])
    ok = chk["ok"]
    print("  T=%d %s [%s]: routed rel err %.3e, layer rel err %.3e; %s -> %s" % (
        T, primary, row["cfg"], chk["routed_rel_err"], chk["total_rel_err"],
        "; ".join(chk["notes"]), "PASS" if ok else "FAIL"), flush=True)
    eager_out0 = chk["out"]

    # --- bytes floor from the experts each set's tokens actually touch ---
    act = []
    for i in range(n):
        logits = torch.mm(xs[i], sets[i]["wg"].t())
        _, ids = route_torch(logits, sets[i].get("bias"))
        act.append(int(torch.unique(ids).numel()))
    row["active_experts"] = sum(act) / n
    row["floor_us"] = bytes_floor_us(row["active_experts"])
    row["compute_floor_us"] = compute_floor_us(T)

    # --- eager, one stream ---
    cfg = cfgs[primary]
    try:
        fns = [(lambda i=i: moe_layer(xs[i], sets[i], cfg)) for i in range(n)]
        row["eager_us"] = time_median_us(fns, warmup, iters)
    except Exception as e:
        errors.append("eager: " + repr(e)[:300])
        ok = False

    # --- CUDA graphs, one per weight set, replayed round-robin ---
    def graph_time(c, dual, tag):
        graphs = []
        try:
            for i in range(n):
                g, out = capture_graph(lambda i=i: moe_layer(xs[i], sets[i], c, dual=dual, side=side))
                graphs.append((g, out))
            # the graph must reproduce the eager result on set 0
            graphs[0][0].replay()
            torch.cuda.synchronize()
            d = rel_err(graphs[0][1], eager_out0.double())
            if not d < REL_TOL:
                errors.append("%s: graph output differs from eager (rel %.3e)" % (tag, d))
                return None, d
            return time_median_us([g.replay for g, _ in graphs], warmup, iters), d
        except Exception as e:
            errors.append("%s: %s" % (tag, repr(e)[:300]))
            return None, None
        finally:
            del graphs

    row["graph_us"], d1 = graph_time(cfg, False, "graph")
    if IS:
        row["graph_dual_us"], d2 = graph_time(cfg, True, "graph_dual")
    else:  # no shared expert: nothing to put on a side stream
        row["graph_dual_us"], d2 = None, None
    row["graph_vs_eager_rel"] = d1
    row["graph_dual_vs_eager_rel"] = d2
    if row["graph_us"] is None or (IS and row["graph_dual_us"] is None):
        ok = False

    # --- other configs: correctness + single-stream graph ---
    for name in cfg_names[1:]:
        c = cfgs[name]
        row["cfg_" + name] = cfg_str(c)
        try:
            chk2 = check_layer(xs[0], sets[0], c, side)
            row["rel_err_" + name] = chk2["rel_err"]
            print("  T=%d %s [%s]: routed rel err %.3e, layer rel err %.3e -> %s" % (
                T, name, cfg_str(c), chk2["routed_rel_err"], chk2["total_rel_err"],
                "PASS" if chk2["ok"] else "FAIL"), flush=True)
            row["ok_" + name] = bool(chk2["ok"])
            if not chk2["ok"]:
                errors.append("%s: check FAIL (rel %.3e)" % (name, chk2["rel_err"]))
                continue
            eager_out0 = chk2["out"]
            row["graph_%s_us" % name], _ = graph_time(c, False, "graph_" + name)
            if row["graph_%s_us" % name] is None:
                row["ok_" + name] = False
        except Exception as e:
            errors.append("%s: %s" % (name, repr(e)[:300]))
            row["ok_" + name] = False

    row["floor_over_graph"] = (row["floor_us"] / row["graph_us"]) if row["graph_us"] else None
    row["ok"] = bool(ok)  # the primary config: check passed and every timing ran
    if errors:
        row["errors"] = errors
    row["seconds"] = round(time.time() - t0, 1)
    del xs
    return row


def measure_copy_gbps(device):
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_median_us([lambda: dst.copy_(src)], 3, 10)
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e9


def main_gpu(args):
    t_start = time.time()
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device visible to torch", flush=True)
        return 2
    if not HAVE_TRITON:
        print("FAIL: triton does not import: %s" % TRITON_IMPORT_ERROR, flush=True)
        return 2
    global ROUTER_CHOICE
    device = torch.device(DEVICE)
    apply_preset(args.preset)
    ROUTER_CHOICE = args.router
    IMPL.update(router="triton", align="triton", act="triton")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    env = {
        "device": torch.cuda.get_device_name(device),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    print("env: " + json.dumps(env), flush=True)
    env["preset"] = PRESET["name"]
    env["preset_shape"] = {k: PRESET[k] for k in ("model", "H", "E", "K", "I", "IS", "shared_gate", "scoring",
                                                  "n_group", "topk_group", "renorm", "scale")}
    print("preset %s (%s): %s; routing %s" % (PRESET["name"], PRESET["model"], shape_str(),
                                            json.dumps(env["preset_shape"])), flush=True)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    if args.configs is None:  # the tuned table only where it applies
        cfg_req = "default" if config_unavailable("tuned") else "default,tuned"
    else:
        cfg_req = args.configs
    cfg_names = [c.strip() for c in cfg_req.split(",") if c.strip()]
    for c in cfg_names:
        if c not in CONFIG_SOURCES:
            print("FAIL: unknown config %r (known: %s)" % (c, ", ".join(CONFIG_SOURCES)), flush=True)
            return 2
    skipped = {c: config_unavailable(c) for c in cfg_names if config_unavailable(c)}
    for c, why in skipped.items():
        print("config %s dropped: %s" % (c, why), flush=True)
    cfg_names = [c for c in cfg_names if c not in skipped]
    if skipped:
        env["configs_dropped"] = skipped
    if not cfg_names:
        print("FAIL: no config left to run", flush=True)
        return 2
    for T in tokens:
        print("T=%d configs: %s" % (T, ", ".join(
            "%s %s" % (c, cfg_str(CONFIG_SOURCES[c](T))) for c in cfg_names)), flush=True)

    with torch.no_grad():
        notes = preflight(device)
        for nline in notes:
            print("preflight: " + nline, flush=True)
        try:
            env["copy_GBps"] = round(measure_copy_gbps(device), 1)
            print("measured device copy: %.0f GB/s (floor uses %.2e B/s)" % (
                env["copy_GBps"], HBM_BYTES_PER_S), flush=True)
        except Exception as e:
            print("copy bandwidth not measured: %r" % (e,), flush=True)

        set_bytes = weight_set_bytes()
        n_sets = max(1, args.sets if args.sets is not None else PRESET["sets"])
        free, _ = torch.cuda.mem_get_info()
        while n_sets > 1 and n_sets * set_bytes > 0.6 * free:
            n_sets -= 1
        sets = [make_weights(device) for _ in range(n_sets)]
        torch.cuda.synchronize()
        env["weight_sets"] = n_sets
        env["weight_set_GB"] = round(set_bytes / 1e9, 3)
        print("weights: %d set(s) of %.2f GB (rotated to defeat L2)" % (n_sets, set_bytes / 1e9),
              flush=True)
        side = torch.cuda.Stream()

        rows = []
        dead = None
        for T in tokens:
            if dead:
                row = {"tokens": T, "preset": PRESET["name"], "floor_us": None, "eager_us": None,
                       "graph_us": None, "graph_dual_us": None, "rel_err": None, "ok": False,
                       "errors": ["skipped: CUDA context unusable after: " + dead]}
            else:
                try:
                    row = run_tokens(T, sets, cfg_names, side, args.warmup, args.iters, device)
                except Exception as e:
                    tb = traceback.format_exc(limit=4)
                    row = {"tokens": T, "preset": PRESET["name"], "floor_us": None, "eager_us": None,
                           "graph_us": None, "graph_dual_us": None, "rel_err": None, "ok": False,
                           "router": router_desc(), "errors": [repr(e)[:400]]}
                    print("  T=%d EXCEPTION:\n%s" % (T, tb), flush=True)
                    try:
                        torch.cuda.synchronize()
                    except Exception as e2:
                        dead = repr(e2)[:200]
            bad_other = [c for c in cfg_names[1:] if row.get("ok_" + c) is False]
            if not row.get("ok") or bad_other:
                print("FAIL T=%d%s: %s" % (
                    T, "" if not row.get("ok") else " (config %s only)" % ",".join(bad_other),
                    "; ".join(row.get("errors", [])) or
                    "rel err %s >= %g or check failed" % (row.get("rel_err"), REL_TOL)), flush=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not dead:
                try:
                    torch.cuda.empty_cache()
                except Exception:
                    pass

    env["seconds_total"] = round(time.time() - t_start, 1)
    env["impl"] = dict(IMPL)
    env["router"] = router_desc()
    env["configs"] = cfg_names
    out_dir = os.environ.get("OUT")
    if out_dir:
        try:
            with open(os.path.join(out_dir, "triton_moe_anchor.json"), "w") as f:
                json.dump({"env": env, "rows": rows}, f, indent=1)
        except Exception as e:
            print("could not write $OUT json: %r" % (e,), flush=True)

    other = cfg_names[1:]
    print("", flush=True)
    print("vLLM-style Triton fused MoE anchor, %s layer (%s), preset %s, %s" % (
        PRESET["model"], shape_str(), PRESET["name"], env["device"]), flush=True)
    print("times in us, median of %d after %d warm-ups, %d weight set(s) rotated; primary config: %s; %s" % (
        args.iters, args.warmup, env.get("weight_sets", 0), cfg_names[0], impl_tag()), flush=True)
    print("router: %s" % router_desc(), flush=True)
    hdr = "%6s %5s %8s %8s %8s %8s %8s" % ("T", "act", "floor", "eager", "graph", "g-dual", "cflops")
    for name in other:
        hdr += " %9s" % ("g-" + name)[:9]
    hdr += " %7s %9s %s" % ("fl/gr", "rel_err", "status")
    print(hdr, flush=True)
    n_fail = 0
    for r in rows:
        line = "%6d %5s %8s %8s %8s %8s %8s" % (
            r["tokens"], fmt(r.get("active_experts"), 1), fmt(r.get("floor_us")), fmt(r.get("eager_us")),
            fmt(r.get("graph_us")), fmt(r.get("graph_dual_us")), fmt(r.get("compute_floor_us")))
        for name in other:
            line += " %9s" % fmt(r.get("graph_%s_us" % name))
        rel = r.get("rel_err")
        bad_other = [name for name in other if r.get("ok_" + name) is False]
        status = "ok" if r.get("ok") else "FAIL"
        if bad_other:
            status += " (FAIL: %s)" % ",".join(bad_other)
        line += " %7s %9s %s" % (fmt(r.get("floor_over_graph"), 2),
                                 ("%.2e" % rel) if isinstance(rel, float) else "-", status)
        if not r.get("ok"):
            n_fail += 1
        print(line, flush=True)
    for r in rows:
        print("  T=%d cfg %s%s" % (r["tokens"], r.get("cfg", "-"), "".join(
            "; %s %s" % (name, r.get("cfg_" + name, "-")) for name in other)), flush=True)
    print("floor = bytes floor at %.1f TB/s; cflops = bf16 FLOP floor at %.0f TFLOP/s; fl/gr = floor / graph" % (
        HBM_BYTES_PER_S / 1e12, BF16_FLOPS_PER_S / 1e12), flush=True)
    n_other = sum(1 for r in rows for name in other if r.get("ok_" + name) is False)
    print("%s: primary config failed at %d of %d token counts; other configs failed %d time(s); %.0f s total" % (
        "FAIL" if (n_fail or n_other) else "PASS", n_fail, len(rows), n_other, env["seconds_total"]), flush=True)
    return 1 if n_fail else 0


# --------------------------------------------------------------------------------------
# CPU self-test of the pure-torch parts (no GPU, no Triton)
# --------------------------------------------------------------------------------------


def _emulate_moe_gemm(A, B, C, topk_w, sorted_ids, expert_ids, ntp, top_k, mul_routed_weight, cfg):
    """Torch emulation of _moe_gemm_kernel's launch grid and indexing (float64 math)."""
    bm, bn, gm = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["GROUP_SIZE_M"]
    em = sorted_ids.shape[0]
    if A.shape[0] < bm:
        em = min(em, A.shape[0] * top_k * bm)
    n = B.shape[1]
    num_pid_m, num_pid_n = cdiv(em, bm), cdiv(n, bn)
    total = int(ntp.reshape(-1)[0])
    num_valid = A.shape[0] * top_k
    seen = set()
    flat_w = topk_w.reshape(-1)
    for pid in range(num_pid_m * num_pid_n):
        per_group = gm * num_pid_n
        first_m = (pid // per_group) * gm
        group_rows = min(num_pid_m - first_m, gm)
        pid_m = first_m + ((pid % per_group) % group_rows)
        pid_n = (pid % per_group) // group_rows
        seen.add((pid_m, pid_n))
        if pid_m * bm >= total:
            continue
        pair = sorted_ids[pid_m * bm:(pid_m + 1) * bm].long()
        ok = pair < num_valid
        e = int(expert_ids[pid_m])
        assert 0 <= e < B.shape[0], "block %d has expert id %d" % (pid_m, e)
        cols = torch.arange(pid_n * bn, (pid_n + 1) * bn)
        bcols = cols % n
        acc = A[pair[ok] // top_k].double() @ B[e][bcols].double().t()
        if mul_routed_weight:
            acc = acc * flat_w[pair[ok]].double()[:, None]
        cm = cols < n
        C[pair[ok][:, None], cols[cm][None, :]] = acc[:, cm].to(C.dtype)
    assert len(seen) == num_pid_m * num_pid_n, "grouped pid mapping is not a bijection"


def _emulate_router_kernel(logits, bias=None):
    """Torch emulation of _router_kernel / _router_grouped_kernel, step by step (fp32)."""
    p = PRESET
    T, ne = logits.shape
    x = logits.float()
    w = torch.empty(T, TOPK, dtype=torch.float32)
    ids = torch.empty(T, TOPK, dtype=torch.int32)

    def argbest(q, best, cols, pad):  # lowest column holding the row's best value
        return cols.expand_as(q).masked_fill(q != best[:, None], pad).min(dim=1).values

    if p["scoring"] == "softmax":
        pad = 1 << (ne - 1).bit_length()
        cols = torch.arange(pad)[None, :]
        xp = torch.full((T, pad), float("-inf"))
        xp[:, :ne] = x
        pr = torch.exp(xp - xp.max(dim=1).values[:, None])
        pr = pr / pr.sum(dim=1)[:, None]
        if p["renorm"]:
            q = pr.clone()
            tot = torch.zeros(T)
            for j in range(TOPK):
                best = q.max(dim=1).values
                idx = argbest(q, best, cols, pad)
                tot += best
                q = q.masked_fill(cols == idx[:, None], -1.0)
        for j in range(TOPK):
            best = pr.max(dim=1).values
            idx = argbest(pr, best, cols, pad)
            w[:, j] = best / tot if p["renorm"] else best
            ids[:, j] = idx.to(torch.int32)
            pr = pr.masked_fill(cols == idx[:, None], -1.0)
        return w, ids
    ng, tg = p["n_group"], p["topk_group"]
    epg = ne // ng
    cols = torch.arange(ne)[None, :]
    grp = cols // epg
    gcols = torch.arange(ng)[None, :]
    sg = 1.0 / (1.0 + torch.exp(-x))
    b = sg + bias.float()[None, :]
    gscore = torch.zeros(T, ng)
    for g in range(ng):
        bg = b.masked_fill(grp != g, float("-inf"))
        m1 = bg.max(dim=1).values
        i1 = argbest(bg, m1, cols, ne)
        m2 = bg.masked_fill(cols == i1[:, None], float("-inf")).max(dim=1).values
        gscore = torch.where(gcols == g, (m1 + m2)[:, None].expand(T, ng), gscore)
    keep = torch.zeros(T, ne, dtype=torch.int32)
    for j in range(tg):
        gbest = gscore.max(dim=1).values
        gi = argbest(gscore, gbest, gcols, ng)
        keep = keep.masked_fill(grp == gi[:, None], 1)
        gscore = gscore.masked_fill(gcols == gi[:, None], float("-inf"))
    sel = b.masked_fill(keep == 0, float("-inf"))
    if p["renorm"]:
        q = sel.clone()
        tot = torch.zeros(T)
        for j in range(TOPK):
            best = q.max(dim=1).values
            idx = argbest(q, best, cols, ne)
            tot += sg.masked_fill(cols != idx[:, None], 0.0).sum(dim=1)
            q = q.masked_fill(cols == idx[:, None], float("-inf"))
        mult = torch.tensor(float(p["scale"]), dtype=torch.float32) / tot
    else:
        mult = torch.zeros(T) + float(p["scale"])
    for j in range(TOPK):
        best = sel.max(dim=1).values
        idx = argbest(sel, best, cols, ne)
        wj = sg.masked_fill(cols != idx[:, None], 0.0).sum(dim=1)
        w[:, j] = wj * mult
        ids[:, j] = idx.to(torch.int32)
        sel = sel.masked_fill(cols == idx[:, None], float("-inf"))
    return w, ids


def _naive_routing(lg, bias=None):
    """Independent per-token routing of the current preset (python floats, float64)."""
    p = PRESET
    ne = len(lg)
    if p["scoring"] == "softmax":
        m = max(lg)
        ex = [math.exp(v - m) for v in lg]
        z = sum(ex)
        sc = [v / z for v in ex]
        selv = list(sc)
    else:
        sc = [1.0 / (1.0 + math.exp(-v)) for v in lg]
        selv = [a + float(b) for a, b in zip(sc, bias)]
        ng, tg = p["n_group"], p["topk_group"]
        epg = ne // ng
        gsc = [sum(sorted(selv[g * epg:(g + 1) * epg])[-2:]) for g in range(ng)]
        keep = set(sorted(range(ng), key=lambda g: -gsc[g])[:tg])
        selv = [v if i // epg in keep else -math.inf for i, v in enumerate(selv)]
    chosen = sorted(range(ne), key=lambda i: -selv[i])[:TOPK]
    ws = [sc[i] for i in chosen]
    if p["renorm"]:
        z = sum(ws)
        ws = [v / z for v in ws]
    return chosen, [v * p["scale"] for v in ws]


def _naive_layer(x, W):
    """Independent float64 per-token forward of the current preset's layer."""
    xd = x.double()
    T = xd.shape[0]
    inter = W["w2"].shape[2]
    out = torch.zeros(T, W["w2"].shape[1], dtype=torch.float64)
    for t in range(T):
        lg = (W["wg"].double() @ xd[t]).tolist()
        chosen, ws = _naive_routing(lg, W.get("bias"))
        for e, wv in zip(chosen, ws):
            h = W["w13"][e].double() @ xd[t]
            a = h[:inter] * torch.sigmoid(h[:inter]) * h[inter:]
            out[t] += wv * (W["w2"][e].double() @ a)
        if "ws13" in W:
            inter_s = W["ws2"].shape[1]
            h = W["ws13"].double() @ xd[t]
            sh = W["ws2"].double() @ (h[:inter_s] * torch.sigmoid(h[:inter_s]) * h[inter_s:])
            if "wsg" in W:
                sh = sh / (1.0 + math.exp(-float(W["wsg"][0].double() @ xd[t])))
            out[t] += sh
    return out


def cpu_selftest():
    try:
        return _cpu_selftest()
    finally:
        apply_preset(DEFAULT_PRESET)


def _cpu_selftest():
    global IMPL
    IMPL = {"router": "torch", "align": "torch", "act": "torch"}
    apply_preset(DEFAULT_PRESET)
    torch.manual_seed(0)
    fails = 0

    def report(name, ok, msg=""):
        nonlocal fails
        fails += 0 if ok else 1
        print("%s %s %s" % ("ok  " if ok else "FAIL", name, msg), flush=True)

    # 1. configs
    want = {1: (16, 64, 128, 1, 4, 4), 8: (16, 64, 128, 1, 4, 4), 64: (32, 64, 128, 1, 4, 3),
            256: (64, 128, 64, 1, 8, 3), 1024: (128, 128, 64, 1, 8, 3), 4096: (128, 128, 64, 1, 8, 3)}
    for T, w in want.items():
        c = vllm_default_config(T)
        got = (c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], c["GROUP_SIZE_M"],
               c["num_warps"], c["num_stages"])
        report("default config T=%d" % T, got == w, str(got))
    report("tuned T=4096 -> key 4096", tuned_config(4096) == TUNED_TABLE[4096])
    report("tuned T=64 -> key 64", tuned_config(64) == TUNED_TABLE[64])
    report("tuned T=1000 -> key 1024", tuned_config(1000) == TUNED_TABLE[1024])
    report("tuned table size", len(TUNED_TABLE) == 28, str(len(TUNED_TABLE)))
    report("tuned applies to deepseek-v2-lite", config_unavailable("tuned") == "")
    for name in PRESETS:
        if name == DEFAULT_PRESET:
            continue
        apply_preset(name)
        why = config_unavailable("tuned")
        try:
            tuned_config(64)
            raised = False
        except ValueError:
            raised = True
        if (E, I) in TUNED_TABLES:
            report("tuned applies to %s (E=%d,N=%d)" % (name, E, I), not why and not raised, why)
        else:
            report("tuned not used for %s (E=%d,N=%d)" % (name, E, I), bool(why) and raised, why)
        report("default config for %s reads its E" % name,
               vllm_default_config(8192) == vllm_default_config(8192, E), cfg_str(vllm_default_config(8192)))
    apply_preset("qwen1.5-moe")
    report("default config E=60 T=8192 -> GROUP_SIZE_M 16", vllm_default_config(8192)["GROUP_SIZE_M"] == 16)
    apply_preset(DEFAULT_PRESET)
    report("default config E=64 T=8192 -> GROUP_SIZE_M 1", vllm_default_config(8192)["GROUP_SIZE_M"] == 1)
    for name, fn in CONFIG_SOURCES.items():
        for T in DEFAULT_TOKENS:
            c = fn(T)
            need = {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"}
            if set(c) != need:
                report("config keys %s T=%d" % (name, T), False, str(sorted(c)))

    # 2. align sizes follow vLLM
    report("align sizes T=1", align_sizes(6, 16, 64) == (96, 6), str(align_sizes(6, 16, 64)))
    report("align sizes T=4096", align_sizes(24576, 128, 64) == (24576 + 64 * 127, cdiv(24576 + 64 * 127, 128)))

    # 3. torch align vs check_align, and vs a naive python version; also the Triton offsets math
    for (T, ne, top, bm) in [(1, 64, 6, 16), (3, 8, 2, 4), (17, 8, 3, 16), (64, 64, 6, 32),
                             (256, 64, 6, 64), (1000, 64, 6, 128), (5, 64, 6, 16),
                             (33, 60, 4, 16), (300, 128, 8, 64), (50, 256, 8, 16), (1, 256, 8, 16)]:
        ids = torch.rand(T, ne).topk(top, dim=-1).indices.to(torch.int32)
        if T == 1000:  # skewed routing: many empty experts
            ids = (torch.rand(T, ne) * torch.linspace(0.01, 1, ne)).topk(top, dim=-1).indices.to(torch.int32)
        out = align_torch(ids, bm, ne)
        ok, msg = check_align(ids, *out, bm, ne)
        report("align_torch T=%d E=%d k=%d BM=%d" % (T, ne, top, bm), ok, msg)
        # naive reference (stable order)
        flat = ids.reshape(-1).tolist()
        numel = len(flat)
        max_padded, max_blocks = align_sizes(numel, bm, ne)
        naive = []
        naive_e = []
        for e in range(ne):
            members = [i for i, v in enumerate(flat) if v == e]
            if not members:
                continue
            padn = cdiv(len(members), bm) * bm
            naive += members + [numel] * (padn - len(members))
            naive_e += [e] * (padn // bm)
        naive_sorted = naive + [numel] * (max_padded - len(naive))
        naive_eids = naive_e + [-1] * (max_blocks - len(naive_e))
        same = (out[0].tolist() == naive_sorted and out[1].tolist() == naive_eids
                and int(out[2][0]) == len(naive))
        report("align_torch == naive T=%d BM=%d" % (T, bm), same)
        # emulate the Triton offsets/scatter kernels' arithmetic
        cnt = torch.zeros(ne, dtype=torch.int32)
        for v in flat:
            cnt[v] += 1
        padded = (cnt + (bm - 1)) // bm * bm
        seg_end = torch.cumsum(padded, 0)
        seg_start = seg_end - padded
        total = int(padded.sum())
        row0 = torch.arange(max_blocks) * bm
        eid = (seg_end[None, :] <= row0[:, None]).to(torch.int32).sum(1)
        eid = torch.where(row0 < total, eid, torch.full_like(eid, -1))
        cursor = seg_start.clone()
        emu_sorted = torch.full((max_padded,), numel, dtype=torch.int32)
        for j in torch.randperm(numel).tolist():  # any atomic order
            e = flat[j]
            emu_sorted[int(cursor[e])] = j
            cursor[e] += 1
        ok2, msg2 = check_align(ids, emu_sorted, eid.to(torch.int32), torch.tensor([total], dtype=torch.int32), bm, ne)
        report("triton-align arithmetic (emulated) T=%d BM=%d" % (T, bm), ok2 and eid.tolist() == naive_eids, msg2)

    # 4. check_align catches corruption
    ids = torch.rand(9, 8).topk(2, dim=-1).indices.to(torch.int32)
    s, e_, n_ = align_torch(ids, 4, 8)
    flat = ids.reshape(-1).long()
    valid_pos = [q for q in range(int(n_[0])) if int(s[q]) < flat.numel()]
    p0 = valid_pos[0]
    p1 = next(q for q in valid_pos if int(flat[s[q]]) != int(flat[s[p0]]))
    s2 = s.clone()
    s2[p0], s2[p1] = s[p1], s[p0]
    ok, msg = check_align(ids, s2, e_, n_, 4, 8)
    report("check_align rejects a swapped pair", not ok, msg)
    e2 = e_.clone()
    e2[0] = (e2[0] + 1) % 8
    ok, msg = check_align(ids, s, e2, n_, 4, 8)
    report("check_align rejects a wrong block expert", not ok, msg)
    n2 = n_ + 4
    ok, msg = check_align(ids, s, e_, n2, 4, 8)
    report("check_align rejects a wrong total", not ok, msg)

    # 5. router check
    apply_preset(DEFAULT_PRESET, E=8, K=3)
    logits = torch.randn(50, 8)
    w, idx = route_torch(logits)
    ok, msg, _ = check_router(logits, w, idx, 8)
    report("check_router accepts torch topk", ok, msg)
    bad = idx.clone()
    bad[:, 2] = torch.argsort(torch.softmax(logits, -1), dim=-1)[:, 0].to(torch.int32)  # the smallest
    ok, msg, _ = check_router(logits, torch.softmax(logits.double(), -1).gather(1, bad.long()).float(), bad, 8)
    report("check_router rejects a non-top-k choice", not ok, msg)
    apply_preset(DEFAULT_PRESET)

    # 5b. every preset's routing at its real E/K/groups: torch ops, the Triton kernels'
    # arithmetic (emulated), an independent per-token version, and the checker's teeth
    gen = torch.Generator().manual_seed(7)
    for name in PRESETS:
        apply_preset(name)
        bias = torch.randn(E, generator=gen) * W_STD if has_bias() else None
        for kind in ("fp32", "bf16"):  # bf16 logits: many exact ties, as on the GPU
            logits = torch.randn(300, E, generator=gen) * 1.7
            if kind == "bf16":
                logits = logits.to(torch.bfloat16)
            w, ids = route_torch(logits, bias)
            ok, msg, _ = check_router(logits, w, ids, E, bias)
            report("router %s torch ops, %s logits" % (name, kind), ok, msg)
            we, ie = _emulate_router_kernel(logits, bias)
            ok, msg, _ = check_router(logits, we, ie, E, bias)
            report("router %s triton arithmetic (emulated), %s logits" % (name, kind), ok, msg)
            if kind == "fp32":
                same = torch.equal(ids.sort(1).values, ie.sort(1).values)
                wd = (w.sort(1).values - we.sort(1).values).abs().max().item()
                report("router %s torch == emulated kernel" % name, same and wd < 1e-6, "max w diff %.1e" % wd)
                nid, nw = [], []
                for t in range(logits.shape[0]):
                    c, ws = _naive_routing(logits[t].double().tolist(), bias)
                    nid.append(c)
                    nw.append(ws)
                nid = torch.tensor(nid)
                nw = torch.tensor(nw, dtype=torch.float64)
                o1, o2 = ids.long().sort(1), nid.sort(1)
                same = torch.equal(o1.values, o2.values)
                wd = (w.double().gather(1, o1.indices) - nw.gather(1, o2.indices)).abs().max().item()
                report("router %s torch == independent per-token routing" % name, same and wd < 1e-6,
                       "max w diff %.1e" % wd)
        # the checker must reject wrong routing of this preset
        logits = torch.randn(300, E, generator=gen) * 1.7
        w, ids = route_torch(logits, bias)
        sc, selv = reference_scores(logits, bias)
        worst = selv.argmin(dim=1)
        bad = ids.clone()
        bad[:, -1] = worst.to(torch.int32)
        ok, msg, _ = check_router(logits, reference_weights(logits, bad, bias).float(), bad, E, bias)
        report("check_router %s rejects the worst expert in place of a chosen one" % name, not ok, msg)
        if PRESET["renorm"]:
            raw = sc.gather(1, ids.long()) * PRESET["scale"]
            ok, msg, _ = check_router(logits, raw.float(), ids, E, bias)
            report("check_router %s rejects weights without renormalisation" % name, not ok, msg)
        else:
            rn = sc.gather(1, ids.long())
            ok, msg, _ = check_router(logits, (rn / rn.sum(1, keepdim=True)).float(), ids, E, bias)
            report("check_router %s rejects renormalised weights" % name, not ok, msg)
        if PRESET["scale"] != 1.0:
            ok, msg, _ = check_router(logits, w / PRESET["scale"], ids, E, bias)
            report("check_router %s rejects weights without routed scaling" % name, not ok, msg)
        if PRESET["n_group"] > 1:
            ng, tg = PRESET["n_group"], PRESET["topk_group"]
            flat = selv.topk(TOPK, dim=1).indices  # no group limit
            diff = int((flat.sort(1).values != ids.long().sort(1).values).any(1).sum())
            ok, msg, _ = check_router(logits, reference_weights(logits, flat, bias).float(),
                                      flat.to(torch.int32), E, bias)
            report("check_router %s rejects top-k without the group limit (%d tokens differ)" % (name, diff),
                   diff > 0 and not ok, msg)
            gmax = selv.view(300, ng, -1).max(dim=-1).values  # group score = max, not top-2 sum
            keep = torch.zeros(300, ng).scatter_(1, gmax.topk(tg, dim=1).indices, 1.0)
            alt = selv.view(300, ng, -1).masked_fill(keep[:, :, None] == 0, float("-inf")).view(300, -1)
            alt = alt.topk(TOPK, dim=1).indices
            diff = int((alt.sort(1).values != ids.long().sort(1).values).any(1).sum())
            ok, msg, _ = check_router(logits, reference_weights(logits, alt, bias).float(),
                                      alt.to(torch.int32), E, bias)
            report("check_router %s rejects max-of-group scores (%d tokens differ)" % (name, diff),
                   diff > 0 and not ok, msg)
            ok, msg, _ = check_router(logits, w, ids, E, bias + 0.3 * torch.randn(E, generator=gen))
            report("check_router %s rejects routing made with another bias" % name, not ok, msg)
        IMPL["router"] = "triton"
        desc = router_desc()
        IMPL["router"] = "torch"
        report("router desc %s" % name, bool(desc), desc)
    apply_preset(DEFAULT_PRESET)

    # 6. the whole routed dataflow with the emulated GEMM, small dims, vs the float64 reference
    try:
        for (T, ne, hid, inter, top, bm, gm) in [(1, 8, 64, 32, 2, 16, 1), (7, 8, 64, 32, 2, 4, 2),
                                                 (40, 8, 48, 24, 3, 16, 4), (33, 16, 64, 40, 4, 8, 1)]:
            apply_preset(DEFAULT_PRESET, K=top)
            Wt = dict(
                wg=torch.randn(ne, hid, dtype=torch.float64) * 0.2,
                w13=torch.randn(ne, 2 * inter, hid, dtype=torch.float64) * 0.2,
                w2=torch.randn(ne, hid, inter, dtype=torch.float64) * 0.2,
                ws13=torch.randn(2 * 2 * inter, hid, dtype=torch.float64) * 0.2,
                ws2=torch.randn(hid, 2 * inter, dtype=torch.float64) * 0.2,
            )
            x = torch.randn(T, hid, dtype=torch.float64)
            cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": gm,
                   "num_warps": 4, "num_stages": 2}
            dbg = {}
            r = routed_experts(x, Wt, cfg, poison=True, dbg=dbg, gemm=_emulate_moe_gemm)
            s = shared_experts(x, Wt)
            ok_a, msg_a = check_align(dbg["topk_ids"], dbg["sorted_ids"], dbg["expert_ids"], dbg["ntp"], bm, ne)
            ref_r, ref_s = reference_layer(x, Wt, dbg["topk_ids"], dbg["topk_w"])
            er = rel_err(r, ref_r)
            es = rel_err(s, ref_s)
            report("routed dataflow T=%d E=%d k=%d BM=%d G=%d" % (T, ne, top, bm, gm),
                   ok_a and er < 1e-12 and es < 1e-12, "routed %.1e shared %.1e; %s" % (er, es, msg_a))
    finally:
        apply_preset(DEFAULT_PRESET)

    # 6b. every preset's whole layer at tiny shapes (its real routing, shared expert / gate /
    # none): check_layer (the GPU path's check, with the emulated GEMM) and an independent
    # per-token float64 forward
    tiny = {"deepseek-v2-lite": dict(H=48, E=8, K=3, I=24, IS=48),
            "qwen1.5-moe": dict(H=64, E=12, K=4, I=32, IS=80),
            "qwen3-30b-a3b": dict(H=64, E=16, K=4, I=24, IS=0),
            "deepseek-v3": dict(H=64, E=64, K=8, I=32, IS=32)}
    torch.manual_seed(3)
    try:
        for name, shp in tiny.items():
            apply_preset(name, **shp)
            Wt = make_weights("cpu", gen_dtype=torch.float64)
            keys = ",".join(sorted(Wt))
            for (T, bm, gm) in [(1, 16, 1), (7, 4, 2), (40, 16, 4)]:
                x = torch.randn(T, H, dtype=torch.float64)
                cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": gm,
                       "num_warps": 4, "num_stages": 2}
                chk = check_layer(x, Wt, cfg, None, gemm=_emulate_moe_gemm)
                naive = _naive_layer(x, Wt)
                en = rel_err(chk["out"], naive)
                report("layer %s tiny T=%d BM=%d G=%d [%s]" % (name, T, bm, gm, keys),
                       chk["ok"] and chk["rel_err"] < 1e-5 and en < 1e-5,
                       "check_layer rel %.1e (routed %.1e), vs independent forward %.1e; %s" % (
                           chk["rel_err"], chk["routed_rel_err"], en, "; ".join(chk["notes"])))
            # a layer whose shared gate or routing scale is dropped must fail the check
            if "wsg" in Wt:
                x = torch.randn(9, H, dtype=torch.float64)
                W2 = dict(Wt)
                W2["wsg"] = torch.full_like(Wt["wsg"], 1e-9)  # sigmoid -> 0.5 instead of the gate
                out = moe_layer(x, W2, cfg, gemm=_emulate_moe_gemm)
                en = rel_err(out, _naive_layer(x, Wt))
                report("%s: the shared gate matters" % name, en > 1e-3, "rel %.1e without it" % en)
    finally:
        apply_preset(DEFAULT_PRESET)

    # 7. floors
    report("floor T=1-ish", abs(bytes_floor_us(6) - (6 * 3 * H * I * 2 + 3 * H * IS * 2 + E * H * 2) / 4.2e12 * 1e6) < 1e-9,
           "%.1f us for 6 experts, %.1f us for 64" % (bytes_floor_us(6), bytes_floor_us(64)))
    for name in PRESETS:
        apply_preset(name)
        report("sizes %s" % name, weight_set_bytes() > 0,
               "%s; %.2f GB a weight set, %d set(s) by default; floor %.1f us for %d experts, %.1f us for all %d" % (
                   shape_str(), weight_set_bytes() / 1e9, PRESET["sets"], bytes_floor_us(TOPK), TOPK,
                   bytes_floor_us(E), E))
    apply_preset(DEFAULT_PRESET)
    print("%s: cpu self-test, %d failure(s)" % ("FAIL" if fails else "PASS", fails), flush=True)
    return 1 if fails else 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default=os.environ.get("ANCHOR_PRESET", DEFAULT_PRESET),
                    help="layer shape and routing (default %s)" % DEFAULT_PRESET)
    ap.add_argument("--tokens", default=os.environ.get("ANCHOR_TOKENS", ",".join(map(str, DEFAULT_TOKENS))))
    ap.add_argument("--configs", default=os.environ.get("ANCHOR_CONFIGS"),
                    help="comma list from: %s; the first is the primary (graph_us etc.); default: "
                         "default,tuned where the tuned table applies (E=64, I=1408), else default"
                         % ", ".join(CONFIG_SOURCES))
    ap.add_argument("--iters", type=int, default=int(os.environ.get("ANCHOR_ITERS", "50")))
    ap.add_argument("--warmup", type=int, default=int(os.environ.get("ANCHOR_WARMUP", "10")))
    ap.add_argument("--sets", type=int,
                    default=int(os.environ["ANCHOR_SETS"]) if os.environ.get("ANCHOR_SETS") else None,
                    help="weight/input sets rotated to defeat L2 (default: 3; 2 for deepseek-v3)")
    ap.add_argument("--router", choices=("auto", "torch"), default=os.environ.get("ANCHOR_ROUTER", "auto"),
                    help="auto: the Triton router kernel, torch ops if it fails its preflight; "
                         "torch: torch ops always")
    ap.add_argument("--cpu-selftest", action="store_true", help="test the pure-torch parts on CPU and exit")
    return ap.parse_args(argv)


if __name__ == "__main__":
    _args = parse_args(sys.argv[1:])
    if _args.cpu_selftest:
        sys.exit(cpu_selftest())
    sys.exit(main_gpu(_args))
