#!/usr/bin/env python3
"""FP8 peer of gpuctx moe bench: vLLM's Triton fused MoE in fp8_w8a8, block_shape=[128,128].

The same command line and the same output as triton_fused_moe.py (the bf16 peer, in this
folder: JSON rows on stdout, an "env:" line, PASS/FAIL, $OUT/..._anchor.json), so that
gpuctx's bench.runPeer reads it unchanged; its env line and rows add "dtype": "fp8".
It imports the bf16 peer (this script's own folder is put first on sys.path) and reuses
its presets, routing, align, silu_and_mul, timing, CUDA graphs, weight-set rotation and
checks; what FP8 changes is replaced here (the bf16 peer's functions look their globals
up at call time, so the module's globals are patched: routed_experts, check_layer,
bytes_floor_us, CONFIG_SOURCES, TUNED_TABLES). The bf16 peer's file is not changed.

Routed experts, as vLLM runs a DeepSeek-V3-style block-FP8 checkpoint with its Triton
path (vllm/model_executor/layers/fused_moe/fused_moe.py, fused_experts_impl):
  weights  w13 [E, 2I, H] and w2 [E, H, I] as float8_e4m3fn codes with a float32
           scale_inv per 128x128 block (w = code * scale_inv): w13_s [E, 2I/128,
           ceil(H/128)], w2_s [E, ceil(H/128), ceil(I/128)].
  quant    x, then silu(gate)*up, quantized per token per 128 columns to E4M3 with a
           float32 scale each (vLLM per_token_group_quant_fp8, its Triton kernel:
           vllm/model_executor/layers/quantization/utils/fp8_utils.py; scale =
           max(amax, 1e-10)/448); vLLM's MoE calls it through moe_kernel_quantize_input
           (vllm/model_executor/layers/fused_moe/utils.py). On CUDA vLLM prefers its CUDA
           op for this step, same rule; the Triton kernel is what is ported here.
  w13/w2   fused_moe_kernel's block-wise fp8 path (use_fp8_w8a8, group_n = group_k =
           128): per K block, accumulator += tl.dot(a, b) * a_scale[:, None] *
           b_scale[None, :], a_scale per token per 128-group, b_scale per [128 N x 128 K]
           block; BLOCK_SIZE_K = min(config's, 128) as invoke_fused_moe_kernel sets it;
           w2 multiplies by the routing weight in fp32 before the cast to bf16.
  the rest as the bf16 peer: gate GEMM in bf16, the Triton router, align, silu_and_mul
           (bf16 in, bf16 out), sum over the K slots.

Weights: the bf16 peer's make_weights draws every set (same N(0, 0.02^2), same order, same
torch.manual_seed(0) stream), then the routed experts are quantized as gpuctx quantizes a
bf16 checkpoint at load (moe/fp8.Quantize): per 128x128 block of each projection, gate
and up on their own, scale_inv = max(amax, 1e-10)/448 in float32, code = E4M3(w /
scale_inv) rounded to nearest even (saturating; a partial last block uses its own amax).
vLLM's kernel indexes w13's scales over the stacked 2I rows, so I must be a multiple of
128 (vLLM requires it of block-FP8 MoE too); every preset's is. The shared expert stays
bf16, as in gpuctx's FP8 layers (moe/stage_experts_fp8.go, sharedStage.uploadFP8): its
FP8 values, quantized the same way and dequantized (code * scale_inv in float32, rounded
to bf16). The router, its correction bias and Qwen2-MoE's shared gate row stay as drawn.

Tile configs: vLLM's tuned table for the shape where vLLM ships one for
dtype=fp8_w8a8,block_shape=[128,128] on NVIDIA_H200 (N = moe_intermediate_size at TP=1,
vLLM's `E, _, N = w2.shape`, as the bf16 peer maps it), picked by the nearest batch size:
  qwen3-30b-a3b      E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json
                     (vllm-project/vllm @ e0055804ee6d; embedded below).
  deepseek-v2-lite   none for E=64,N=1408; qwen1.5-moe none for E=60,N=1408; deepseek-v3 none
                     for E=256,N=2048 (vLLM's E=256 H200 tables are for tensor-parallel
                     shards: N=256, 512, 1024 at TP 8, 4, 2).
Else vLLM's default for block FP8 (get_default_config, its fp8_w8a8 + block_shape branch
after PR #34846): BLOCK_SIZE_M 16 up to 64 tokens else 64, BLOCK_SIZE_N 128, BLOCK_SIZE_K
128, GROUP_SIZE_M 1 up to 16 tokens else 32, 4 warps, 3 stages. "old_default" is the
branch before that PR (64/128/128, GROUP_SIZE_M 32), run only if asked (--configs).
The env line names the table used ("tuned_table") and the configs that run.

Checks, per token count, on weight set 0 (the bf16 peer's router and align checks too):
  act quant   both quantized activations: every scale = max(amax, 1e-10)/448 of its group
              (relative 1e-5) and every code within half an E4M3 step of its value.
  fp8 GEMMs   w13's output and w2's (routing weight applied) against float64 products of
              the kernel's own FP8 inputs (dequantized activations and weights):
              max|d| / max|ref| < 3e-2 (a wrong scale index is off by far more).
  layer       the routed part and the whole layer against a float64 reference from the
              dequantized weights and the bf16 activations: max|d| / max|ref| < 1e-1.
              The activations' two E4M3 roundings alone put w8a8 about 4-5% from it
              (a float64 model of this layer's quantization: 4.6%), so 3e-2 would fail
              a correct kernel; 1e-1 is also gpuctx's own tolerance for its fp8 outputs.
rel_err in a row is the layer's; ok needs all of them. The graph-vs-eager check is the
bf16 peer's (relative Frobenius, 2e-2).

Floor: floor_us = (distinct experts touched * (3*H*I FP8 bytes + their block scales, 4 B
each) + 3*H*IS*2 (bf16 shared expert) + E*H*2 (router) (+ H*2 shared gate, + E*4 bias)) /
the copy bandwidth measured in this run (bytes read + written per second, as gpuctx's
ceiling; the bf16 peer's 4.2e12 B/s if it could not be measured). compute_floor_us is
the bf16 peer's (every FLOP at its bf16 rate; context only).

Output: as the bf16 peer; the env line adds dtype, quant, tuned_table, configs; rows add
"dtype": "fp8"; the JSON file is $OUT/triton_moe_fp8_anchor.json.

Usage:
  PYTHONUNBUFFERED=1 python3 triton_fused_moe_fp8.py [--preset deepseek-v3] [--tokens 1,8,64]
        [--configs default,tuned] [--sets 1] [--router auto|torch]
  python3 triton_fused_moe_fp8.py --cpu-selftest   # torch on the CPU only: no GPU, no Triton
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_fused_moe as tfm  # noqa: E402  (the bf16 peer, this folder)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton, tl = tfm.triton, tfm.tl
HAVE_TRITON = tfm.HAVE_TRITON

BLOCK = 128                  # weight_block_size [128, 128], and the activations' group
BLOCK_SHAPE = [BLOCK, BLOCK]  # vLLM's block_shape = [block_n, block_k]
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0              # torch.finfo(torch.float8_e4m3fn).max (vLLM get_fp8_min_max)
SCALE_EPS = 1e-10            # vLLM per_token_group_quant_fp8's eps; gpuctx moe/fp8 scaleEps
LAYER_TOL = 1e-1             # layer vs float64 from the dequantized weights (see the docstring)
GEMM_TOL = 3e-2              # each FP8 GEMM vs float64 of its own FP8 inputs
QUANT_SCALE_TOL = 1e-5       # activation scales vs max(amax, eps)/448
VLLM_CONFIGS_COMMIT = "e0055804ee6d"
DTYPE_TAG = "fp8"            # the env line's and rows' "dtype": gpuctx's --dtype name
ANCHOR_JSON = "triton_moe_fp8_anchor.json"

# The floor's bandwidth: the copy measured by main_gpu, else the bf16 peer's constant.
FLOOR = {"bytes_per_s": tfm.HBM_BYTES_PER_S, "source": "the bf16 peer's constant (copy not measured)"}

# --------------------------------------------------------------------------------------
# E4M3 conversions (the only places that touch torch's float8 dtype)
# --------------------------------------------------------------------------------------


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 values within [-448, 448] -> float8_e4m3fn, round to nearest even (torch's
    cast; it agrees with gpuctx's fp8.E4M3 in that range)."""
    return v.to(FP8_DTYPE)


def from_e4m3(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32 (exact)."""
    return q.to(torch.float32)


def codes_u8(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def as_fp8(u: torch.Tensor) -> torch.Tensor:
    return u.view(FP8_DTYPE)


# --------------------------------------------------------------------------------------
# Weights: gpuctx's quantizer (moe/fp8/block.go Quantize), and the set of one preset
# --------------------------------------------------------------------------------------


def quant_weight_blocks(w: torch.Tensor):
    """gpuctx's fp8.Quantize of one [R, C] matrix (nn.Linear layout) in 128x128 blocks, in
    float32: scale_inv = max(amax, 1e-10) / 448 per block (a partial last block row or
    column uses its own amax), code = E4M3(w / scale_inv), nearest even, saturating.
    Returns (codes float8_e4m3fn [R, C], scale_inv float32 [ceil(R/128), ceil(C/128)])."""
    R, C = w.shape
    rb, cb = tfm.cdiv(R, BLOCK), tfm.cdiv(C, BLOCK)
    wf = w.to(torch.float32)
    if rb * BLOCK != R or cb * BLOCK != C:  # zeros never raise a block's amax
        wf = F.pad(wf, (0, cb * BLOCK - C, 0, rb * BLOCK - R))
    blk = wf.reshape(rb, BLOCK, cb, BLOCK)
    amax = blk.abs().amax(dim=3).amax(dim=1)  # [rb, cb]
    s = amax.clamp(min=SCALE_EPS) / FP8_MAX
    q = to_e4m3((blk / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX))
    codes = q.reshape(rb * BLOCK, cb * BLOCK)[:R, :C].contiguous()
    return codes, s.contiguous()


def dequant_weight(codes: torch.Tensor, s: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """code * scale_inv of its block, in dtype (float64: exact; float32: as gpuctx's
    fp8.Weight.Dequantize rounds it)."""
    R, C = codes.shape
    sc = s.to(dtype).repeat_interleave(BLOCK, dim=0)[:R].repeat_interleave(BLOCK, dim=1)[:, :C]
    return from_e4m3(codes).to(dtype) * sc


def dequant_act(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Activations quantized per token per 128 columns -> float64 (exact)."""
    return from_e4m3(q).double() * s.double().repeat_interleave(BLOCK, dim=1)[:, :q.shape[1]]


def quant_experts(w: torch.Tensor, parts: int = 1):
    """[E, R, C] -> (codes float8 [E, R, C], scale_inv float32 [E, parts*ceil(R/parts/128),
    ceil(C/128)]): each expert's `parts` row slices (w13: gate rows, then up rows) quantized
    on their own, as gpuctx does (fp8Experts.upload), one expert at a time (DeepSeek-V3's
    w13 in float32 at once would take 30 GB)."""
    ne, R, C = w.shape
    assert R % parts == 0
    rp = R // parts
    rbp, cb = tfm.cdiv(rp, BLOCK), tfm.cdiv(C, BLOCK)
    codes = torch.empty(ne, R, C, dtype=torch.uint8, device=w.device)
    scales = torch.empty(ne, parts * rbp, cb, dtype=torch.float32, device=w.device)
    for e in range(ne):
        for p in range(parts):
            q, s = quant_weight_blocks(w[e, p * rp:(p + 1) * rp])
            codes[e, p * rp:(p + 1) * rp].copy_(codes_u8(q))
            scales[e, p * rbp:(p + 1) * rbp].copy_(s)
    return as_fp8(codes), scales


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w [R, C] -> its FP8 values in bf16: quantized per 128x128 block, dequantized in float32,
    rounded to bf16 (gpuctx: sharedStage.uploadFP8, the dense shared expert of an FP8 layer)."""
    q, s = quant_weight_blocks(w)
    return dequant_weight(q, s, torch.float32).to(torch.bfloat16)


def check_fp8_shape() -> str:
    """'' if the current preset's shape runs in vLLM's block-FP8 MoE, else why not."""
    if tfm.I % BLOCK:
        return "moe_intermediate_size %d is not a multiple of %d: vLLM's block-FP8 MoE needs it" % (tfm.I, BLOCK)
    if tfm.H % BLOCK:
        return "hidden size %d is not a multiple of %d (per_token_group_quant_fp8's group)" % (tfm.H, BLOCK)
    return ""


def make_weights_fp8(device, gen_dtype=tfm.DTYPE):
    """One weight set: the bf16 peer's draw (tfm.make_weights: same order, same generator),
    the routed experts then held as FP8 codes + block scales (w13, w13_s, w2, w2_s), the shared
    expert as its FP8 values in bf16 (ws13, ws2); wg, wsg and bias as drawn."""
    why = check_fp8_shape()
    if why:
        raise ValueError(why)
    W = tfm.make_weights(device, gen_dtype=gen_dtype)
    Q = {"wg": W.pop("wg")}
    Q["w13"], Q["w13_s"] = quant_experts(W.pop("w13"), parts=2)
    Q["w2"], Q["w2_s"] = quant_experts(W.pop("w2"))
    if "ws13" in W:
        ws13 = W.pop("ws13")
        Q["ws13"] = torch.cat([fp8_round_trip(ws13[:tfm.IS]), fp8_round_trip(ws13[tfm.IS:])]).contiguous()
        del ws13
        Q["ws2"] = fp8_round_trip(W.pop("ws2")).contiguous()
    Q.update(W)  # wsg (Qwen2-MoE's shared gate row), bias (DeepSeek-V3's correction bias)
    return Q


def fp8_expert_bytes() -> int:
    """One routed expert's bytes: codes of gate, up and down, and their float32 block scales
    (gpuctx's fp8Sizes for one expert)."""
    bh, bi = tfm.cdiv(tfm.H, BLOCK), tfm.cdiv(tfm.I, BLOCK)
    return 2 * tfm.I * tfm.H + tfm.H * tfm.I + (2 * bi * bh + bh * bi) * 4


def _dense_bytes() -> int:
    """Router (bf16), shared expert (bf16), shared gate row (bf16), correction bias (fp32)."""
    n = tfm.E * tfm.H * 2 + 3 * tfm.H * tfm.IS * 2
    if tfm.PRESET["shared_gate"]:
        n += tfm.H * 2
    if tfm.has_bias():
        n += tfm.E * 4
    return n


def fp8_set_bytes() -> int:
    return tfm.E * fp8_expert_bytes() + _dense_bytes()


def fp8_bytes_floor_us(active_experts: float) -> float:
    """Replaces the bf16 peer's bytes_floor_us: FP8 bytes and scales of the experts touched,
    the bf16 rest, over the measured copy bandwidth."""
    return (active_experts * fp8_expert_bytes() + _dense_bytes()) / FLOOR["bytes_per_s"] * 1e6


# --------------------------------------------------------------------------------------
# Tile configs
# --------------------------------------------------------------------------------------


def fp8_default_config(M: int, num_experts: int | None = None) -> dict:
    """vLLM get_default_config(), its dtype == "fp8_w8a8" and block_shape branch, as PR #34846
    (merged 2026-02) rewrote it (vllm/model_executor/layers/fused_moe/fused_moe.py; CUDA: 3
    stages). It does not depend on E."""
    return {
        "BLOCK_SIZE_M": 16 if M <= 64 else 64,
        "BLOCK_SIZE_N": BLOCK_SHAPE[0],
        "BLOCK_SIZE_K": BLOCK_SHAPE[1],
        "GROUP_SIZE_M": 1 if M <= 16 else 32,
        "num_warps": 4,
        "num_stages": 3,
    }


def fp8_old_default_config(M: int, num_experts: int | None = None) -> dict:
    """The same branch before PR #34846 (not run unless asked)."""
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": BLOCK_SHAPE[0], "BLOCK_SIZE_K": BLOCK_SHAPE[1],
            "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 3}


# vllm/model_executor/layers/fused_moe/configs/
# E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json
# (vllm-project/vllm @ e0055804ee6d): the table vLLM runs for Qwen3-30B-A3B-FP8 (TP1) on an
# H200. Same values, one line each.
_TUNED_H200_FP8_E128_N768_JSON = """
{
 "1":    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64,  "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 3},
 "2":    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 4},
 "4":    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 3},
 "8":    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 5},
 "16":   {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 3},
 "24":   {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 5},
 "32":   {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 3},
 "48":   {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 3},
 "64":   {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 3},
 "96":   {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 3},
 "128":  {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,  "num_warps": 4, "num_stages": 3},
 "256":  {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 4},
 "512":  {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 4},
 "1024": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 4},
 "1536": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 4},
 "2048": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 4},
 "3072": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 4},
 "4096": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16, "num_warps": 4, "num_stages": 4}
}
"""
# (E, N=I) -> {batch size: config}; the bf16 peer's tuned_config and config_unavailable read
# TUNED_TABLES, which _install puts in their module.
FP8_TUNED_TABLES = {(128, 768): {int(k): v for k, v in json.loads(_TUNED_H200_FP8_E128_N768_JSON).items()}}
FP8_TUNED_FILES = {(128, 768): "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"}

FP8_CONFIG_SOURCES = {
    "default": fp8_default_config,
    "tuned": tfm.tuned_config,  # vLLM's nearest-batch-size rule over TUNED_TABLES
    "old_default": fp8_old_default_config,
}


def tuned_table_desc() -> str:
    """The tuned table the current preset uses, or why none."""
    f = FP8_TUNED_FILES.get((tfm.E, tfm.I))
    if f:
        return "%s (vllm-project/vllm @ %s, vllm/model_executor/layers/fused_moe/configs/)" % (f, VLLM_CONFIGS_COMMIT)
    return ("none: vLLM ships no E=%d,N=%d,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json; "
            "vLLM's default block-FP8 config runs" % (tfm.E, tfm.I))


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------
if HAVE_TRITON:

    # vllm/model_executor/layers/quantization/utils/fp8_utils.py (vllm-project/vllm @
    # 007d50058a06): _per_token_group_quant_fp8, row-major scales, with use_ue8m0 False (its
    # value on Hopper) and that branch left out.
    @triton.jit
    def _per_token_group_quant_fp8(
        # Pointers to inputs and output
        y_ptr,
        y_q_ptr,
        y_s_ptr,
        group_size,
        # Num columns of y
        y_num_columns,
        y_row_stride,
        # Avoid to divide zero
        eps,
        # Information for float8
        fp8_min,
        fp8_max,
        # Meta-parameters
        BLOCK: tl.constexpr,
    ):
        """A Triton-accelerated function to perform per-token-group
        quantization on a tensor.
        This function converts the tensor values into float8 values.
        """
        groups_per_row = y_num_columns // group_size

        # Map the program id to the row of X and Y it should compute.
        g_id = tl.program_id(0)
        row = g_id // groups_per_row
        row_g_id = g_id % groups_per_row

        # Ensure offset calculations use int64 to prevent overflow
        y_ptr_offset = (row.to(tl.int64) * y_row_stride) + (row_g_id.to(tl.int64) * group_size)
        y_ptr += y_ptr_offset

        y_q_ptr_offset = g_id.to(tl.int64) * group_size
        y_q_ptr += y_q_ptr_offset
        y_s_ptr += g_id

        cols = tl.arange(0, BLOCK)  # N <= BLOCK
        mask = cols < group_size

        y = tl.load(y_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # Quant
        _absmax = tl.maximum(tl.max(tl.abs(y)), eps)
        y_s = _absmax / fp8_max
        y_q = tl.clamp(y / y_s, fp8_min, fp8_max).to(y_q_ptr.dtype.element_ty)

        tl.store(y_q_ptr + cols, y_q, mask=mask)
        tl.store(y_s_ptr, y_s)

    # vllm/model_executor/layers/fused_moe/fused_moe.py (vllm-project/vllm @ 13cb3e44373b):
    # fused_moe_kernel with use_fp8_w8a8 and group_n, group_k > 0 (block-wise), every other
    # quantization branch, the bias and the expert-parallel "-1" block left out (this peer
    # has neither). As in the bf16 peer: the sorted ids widened to int64 and EM, num_valid
    # not specialized (no recompile per token count); tl.minimum for vLLM's min.
    @triton.jit(do_not_specialize=["EM", "num_valid_tokens"])
    def fused_moe_kernel_fp8_block(
        # Pointers to matrices
        a_ptr,
        b_ptr,
        c_ptr,
        a_scale_ptr,
        b_scale_ptr,
        topk_weights_ptr,
        sorted_token_ids_ptr,
        expert_ids_ptr,
        num_tokens_post_padded_ptr,
        # Matrix dimensions
        N,
        K,
        EM,
        num_valid_tokens,
        # Strides
        stride_am,
        stride_ak,
        stride_be,
        stride_bk,
        stride_bn,
        stride_cm,
        stride_cn,
        stride_asm,
        stride_ask,
        stride_bse,
        stride_bsk,
        stride_bsn,
        # Block size for block-wise quantization
        group_n: tl.constexpr,
        group_k: tl.constexpr,
        # Meta-parameters
        BLOCK_SIZE_M: tl.constexpr,
        BLOCK_SIZE_N: tl.constexpr,
        BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr,
        top_k: tl.constexpr,
        compute_type: tl.constexpr,
    ):
        """C[pair, :] = A[pair // top_k, :] @ B[expert(pair)]^T (* routing weight), A and B in
        FP8 with a_scale per token per group_k columns and b_scale per group_n x group_k block."""
        # Map program ids `pid` to the block of C it should compute, grouped for L2 reuse.
        pid = tl.program_id(axis=0)
        num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
        num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
        num_pid_in_group = GROUP_SIZE_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_SIZE_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
        if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
            return
        offs_token_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
        offs_token = tl.load(sorted_token_ids_ptr + offs_token_id).to(tl.int64)
        token_mask = offs_token < num_valid_tokens

        off_experts = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

        offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        a_ptrs = a_ptr + (offs_token[:, None] // top_k * stride_am + offs_k[None, :] * stride_ak)

        b_ptrs = b_ptr + off_experts * stride_be + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)

        # block-wise
        a_scale_ptrs = a_scale_ptr + (offs_token // top_k) * stride_asm
        offs_bsn = offs_bn // group_n
        b_scale_ptrs = b_scale_ptr + off_experts * stride_bse + offs_bsn * stride_bsn

        # Accumulate a [BLOCK_SIZE_M, BLOCK_SIZE_N] block of C in fp32.
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            # Load the next block of A and B, generate a mask by checking the K dimension.
            a = tl.load(
                a_ptrs,
                mask=token_mask[:, None] & (offs_k[None, :] < K - k * BLOCK_SIZE_K),
                other=0.0,
            )
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
            # We accumulate along the K dimension.
            k_start = k * BLOCK_SIZE_K
            offs_ks = k_start // group_k
            a_scale = tl.load(a_scale_ptrs + offs_ks * stride_ask, mask=token_mask, other=0.0)
            b_scale = tl.load(b_scale_ptrs + offs_ks * stride_bsk)

            accumulator += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
            # Advance the ptrs to the next K block.
            a_ptrs += BLOCK_SIZE_K * stride_ak
            b_ptrs += BLOCK_SIZE_K * stride_bk

        if MUL_ROUTED_WEIGHT:
            moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)
            accumulator = accumulator * moe_weight[:, None]
        accumulator = accumulator.to(compute_type)

        # Write back the block of the output
        offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
        c_mask = token_mask[:, None] & (offs_cn[None, :] < N)
        tl.store(c_ptrs, accumulator, mask=c_mask)


# --------------------------------------------------------------------------------------
# Stage wrappers
# --------------------------------------------------------------------------------------


def per_token_group_quant_fp8_triton(x: torch.Tensor, group_size: int = BLOCK, eps: float = SCALE_EPS):
    """vLLM per_token_group_quant_fp8 (fp8_utils.py), its Triton path with row-major scales:
    x [M, K] -> (x_q float8_e4m3fn [M, K], x_s float32 [M, K // group_size])."""
    assert x.shape[-1] % group_size == 0, (
        "the last dimension of `x` %d must be divisible by `group_size` %d" % (x.shape[-1], group_size))
    assert x.stride(-1) == 1, "`x` groups must be contiguous"
    x_q = torch.empty(x.shape, device=x.device, dtype=FP8_DTYPE)
    x_s = torch.empty(x.shape[:-1] + (x.shape[-1] // group_size,), device=x.device, dtype=torch.float32)
    M = x.numel() // group_size
    N = group_size
    BLOCK_ = triton.next_power_of_2(N)
    # heuristics for number of warps
    num_warps = min(max(BLOCK_ // 256, 1), 8)
    num_stages = 1
    _per_token_group_quant_fp8[(M,)](
        x, x_q, x_s, group_size, x.shape[1], x.stride(0), eps,
        fp8_min=-FP8_MAX, fp8_max=FP8_MAX, BLOCK=BLOCK_, num_warps=num_warps, num_stages=num_stages)
    return x_q, x_s


def per_token_group_quant_fp8_torch(x: torch.Tensor, group_size: int = BLOCK, eps: float = SCALE_EPS):
    """The same quantization in torch ops (float32, IEEE division): the fallback if the Triton
    kernel fails its preflight, and the CPU self-test's. CUDA-graph safe."""
    assert x.shape[-1] % group_size == 0
    R, C = x.shape
    g = x.to(torch.float32).reshape(R, C // group_size, group_size)
    s = g.abs().amax(dim=-1).clamp(min=eps) / FP8_MAX
    q = to_e4m3((g / s[:, :, None]).clamp(-FP8_MAX, FP8_MAX)).reshape(R, C)
    return q, s


def act_quant(x: torch.Tensor):
    if tfm.IMPL.get("quant") == "triton":
        return per_token_group_quant_fp8_triton(x)
    return per_token_group_quant_fp8_torch(x)


def fp8_moe_gemm(A, A_scale, B, B_scale, C, topk_w, sorted_ids, expert_ids, ntp, top_k, mul_routed_weight, cfg):
    """vLLM invoke_fused_moe_kernel (fused_moe.py), use_fp8_w8a8 with block_shape [128, 128]:
    A [rows, K] float8 with A_scale [rows, K/128]; B [E, N, K] float8 with B_scale
    [E, N/128, K/128]; C [rows*top_k, N] bf16."""
    assert A.dtype == FP8_DTYPE and B.dtype == FP8_DTYPE and C.dtype == torch.bfloat16
    assert A_scale.dtype == torch.float32 and A_scale.ndim == 2 and B_scale.dtype == torch.float32 and B_scale.ndim == 3
    assert A.stride(1) == 1 and B.stride(2) == 1 and C.stride(1) == 1 and sorted_ids.stride(0) == 1
    assert topk_w.stride(1) == 1
    assert B.shape[2] == A.shape[1] and C.shape[1] == B.shape[1] and A_scale.shape[0] == A.shape[0]
    assert tfm.cdiv(B.size(-2), BLOCK_SHAPE[0]) == B_scale.size(-2)
    assert tfm.cdiv(B.size(-1), BLOCK_SHAPE[1]) == B_scale.size(-1)
    assert tfm.cdiv(A.size(-1), BLOCK_SHAPE[1]) == A_scale.size(-1)
    bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
    bk = min(cfg["BLOCK_SIZE_K"], min(BLOCK_SHAPE[0], BLOCK_SHAPE[1]))
    em = sorted_ids.shape[0]
    if A.shape[0] < bm:  # small batch: at most rows*top_k non-empty blocks
        em = min(em, A.shape[0] * top_k * bm)
    n, k = B.shape[1], B.shape[2]
    grid = (tfm.cdiv(em, bm) * tfm.cdiv(n, bn),)
    fused_moe_kernel_fp8_block[grid](
        A, B, C, A_scale, B_scale, topk_w, sorted_ids, expert_ids, ntp,
        n, k, em, A.shape[0] * top_k,
        A.stride(0), A.stride(1),
        B.stride(0), B.stride(2), B.stride(1),
        C.stride(0), C.stride(1),
        A_scale.stride(0), A_scale.stride(1),
        B_scale.stride(0), B_scale.stride(2), B_scale.stride(1),
        group_n=BLOCK_SHAPE[0], group_k=BLOCK_SHAPE[1],
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=cfg["GROUP_SIZE_M"],
        MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=tl.bfloat16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


# --------------------------------------------------------------------------------------
# The layer (replaces the bf16 peer's routed_experts; moe_layer and shared_experts reused)
# --------------------------------------------------------------------------------------


def routed_experts_fp8(x, W, cfg, poison=False, dbg=None, gemm=None):
    """vLLM fused_experts_impl (one chunk) with use_fp8_w8a8 and block_shape [128, 128]:
    router -> align -> quantize x -> w13 -> silu_and_mul -> quantize -> w2 -> sum."""
    gemm = gemm or fp8_moe_gemm
    T = x.shape[0]
    ne, two_i, hid = W["w13"].shape
    inter = two_i // 2
    top = tfm.TOPK
    logits = torch.mm(x, W["wg"].t())
    topk_w, topk_ids = tfm.route(logits, W.get("bias"))
    sorted_ids, expert_ids, ntp = tfm.align(topk_ids, cfg["BLOCK_SIZE_M"], ne)
    pairs = T * top
    cache13 = torch.empty(pairs * max(two_i, hid), device=x.device, dtype=x.dtype)
    cache1 = cache13[: pairs * two_i].view(pairs, two_i)
    cache3 = cache13[: pairs * hid].view(pairs, hid)
    cache2 = torch.empty(pairs, inter, device=x.device, dtype=x.dtype)
    if poison:  # unwritten rows then show up as NaN in the output
        cache13.fill_(float("nan"))
        cache2.fill_(float("nan"))
    xq, xs = act_quant(x)
    gemm(xq, xs, W["w13"], W["w13_s"], cache1, topk_w, sorted_ids, expert_ids, ntp, top, False, cfg)
    if dbg is not None:  # cache3 overwrites cache1 below
        dbg.update(xq=xq, xs=xs, cache1=cache1.clone())
    tfm.silu_and_mul(cache1, cache2)
    aq, a_s = act_quant(cache2)
    gemm(aq, a_s, W["w2"], W["w2_s"], cache3, topk_w, sorted_ids, expert_ids, ntp, 1, True, cfg)
    out = cache3.view(T, top, hid).sum(dim=1)
    if dbg is not None:
        dbg.update(logits=logits, topk_w=topk_w, topk_ids=topk_ids, sorted_ids=sorted_ids,
                   expert_ids=expert_ids, ntp=ntp, cache2=cache2, aq=aq, a_s=a_s, cache3=cache3)
    return out


# --------------------------------------------------------------------------------------
# References and checks
# --------------------------------------------------------------------------------------


def rel_max(got, ref) -> float:
    """max|got - ref| / max|ref| (NaN if got has NaN)."""
    ref = ref.double()
    d = (got.double() - ref).abs().max().item()
    n = ref.abs().max().item()
    return d / n if n > 0 else d


def reference_layer_fp8(x, W, topk_ids, topk_w):
    """The bf16 peer's float64 per-expert loop with the routed experts' dequantized weights;
    returns (routed, shared)."""
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
        h = xd[t] @ dequant_weight(W["w13"][e], W["w13_s"][e]).t()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = a @ dequant_weight(W["w2"][e], W["w2_s"][e]).t()
        routed.index_add_(0, t, y * wts[sel, None])
    if "ws13" not in W:
        return routed, torch.zeros_like(routed)
    inter_s = W["ws2"].shape[1]
    hs = xd @ W["ws13"].double().t()
    shared = (F.silu(hs[:, :inter_s]) * hs[:, inter_s:]) @ W["ws2"].double().t()
    if "wsg" in W:
        shared = shared * torch.sigmoid(xd @ W["wsg"].double().t())
    return routed, shared


def gemm_rel_err(Aq, As, Bq, Bs, C, tok, exp, wts=None) -> float:
    """One FP8 GEMM's output rows p of C against float64: deq(Aq[tok[p]]) @ deq(Bq[exp[p]])^T
    (* wts[p]); max|d| / max|ref| over the rows (NaN propagates)."""
    Ad = dequant_act(Aq, As)
    Cd = C.double()
    diffs, refs = [], []
    for e in torch.unique(exp).tolist():
        sel = (exp == e).nonzero(as_tuple=True)[0]
        ref = Ad[tok[sel]] @ dequant_weight(Bq[e], Bs[e]).t()
        if wts is not None:
            ref = ref * wts[sel, None]
        diffs.append((Cd[sel] - ref).abs().max())
        refs.append(ref.abs().max())
    if not diffs:
        return 0.0
    d = torch.stack(diffs).max().item()
    r = torch.stack(refs).max().item()
    return d / r if r > 0 else d


def check_act_quant(y, q, s, group: int = BLOCK):
    """(ok, scale error, slack): every group's scale is max(amax, eps)/448 (relative
    QUANT_SCALE_TOL) and every code is within half an E4M3 step of y / scale (slack <= 0;
    the step is 2^-3 of the value's binade, 2^-9 below 2^-6)."""
    yd = y.double()
    R, Cc = yd.shape
    g = yd.reshape(R, Cc // group, group)
    s_ref = g.abs().amax(dim=-1).clamp(min=SCALE_EPS) / FP8_MAX
    sd = s.double()
    e_s = ((sd - s_ref).abs() / s_ref).max().item()
    deq = from_e4m3(q).double().reshape(R, Cc // group, group) * sd[:, :, None]
    half_step = g.abs() * 2.0 ** -4 + sd[:, :, None] * 2.0 ** -10
    slack = ((deq - g).abs() - half_step * 1.001).max().item()
    return (e_s < QUANT_SCALE_TOL and slack <= 0), e_s, slack


def check_layer_fp8(x, W, cfg, side, gemm=None):
    """Replaces the bf16 peer's check_layer: one poisoned run, then the router and align
    checks (the bf16 peer's), the activation quantizer, each FP8 GEMM against float64 of its
    own inputs, and the layer against float64 from the dequantized weights."""
    dbg = {}
    out = tfm.moe_layer(x, W, cfg, dual=False, side=side, poison=True, dbg=dbg, gemm=gemm)
    if x.is_cuda:
        torch.cuda.synchronize()
    ne, top, T = tfm.E, tfm.TOPK, x.shape[0]
    msgs = []
    ok_r, msg_r, _ = tfm.check_router(dbg["logits"], dbg["topk_w"], dbg["topk_ids"], ne, W.get("bias"))
    msgs.append(msg_r)
    ok_a, msg_a = tfm.check_align(dbg["topk_ids"], dbg["sorted_ids"], dbg["expert_ids"], dbg["ntp"],
                                  cfg["BLOCK_SIZE_M"], ne)
    msgs.append(msg_a)
    ok_x, es_x, sl_x = check_act_quant(x, dbg["xq"], dbg["xs"])
    ok_h, es_h, sl_h = check_act_quant(dbg["cache2"], dbg["aq"], dbg["a_s"])
    ok_q = ok_x and ok_h
    msgs.append("act quant %s (scale err %.1e/%.1e, slack %.1e/%.1e)" % (
        "ok" if ok_q else "FAILED", es_x, es_h, sl_x, sl_h))
    ids = dbg["topk_ids"].clamp(0, ne - 1)
    flat = ids.reshape(-1).long()
    tok = torch.arange(T, device=x.device).repeat_interleave(top)
    e_w13 = gemm_rel_err(dbg["xq"], dbg["xs"], W["w13"], W["w13_s"], dbg["cache1"], tok, flat)
    pair = torch.arange(T * top, device=x.device)
    e_w2 = gemm_rel_err(dbg["aq"], dbg["a_s"], W["w2"], W["w2_s"], dbg["cache3"], pair, flat,
                        dbg["topk_w"].reshape(-1).double())
    e_gemm = max(e_w13, e_w2)
    if math.isnan(e_w13) or math.isnan(e_w2):
        e_gemm = float("nan")
    msgs.append("fp8 GEMMs vs float64 of their FP8 inputs: w13 %.2e, w2 %.2e (tol %g)" % (e_w13, e_w2, GEMM_TOL))
    # float64 weights of the preset's routing at the chosen experts (the ids themselves were
    # checked above); a bad id shows up in check_router, not here
    ref_w = tfm.reference_weights(dbg["logits"], ids, W.get("bias"))
    ref_routed, ref_shared = reference_layer_fp8(x, W, ids, ref_w)
    e_routed = rel_max(dbg["routed"], ref_routed)
    e_total = rel_max(out, ref_routed + ref_shared)
    worst = max(e_routed, e_total)
    if math.isnan(worst) or math.isnan(e_routed) or math.isnan(e_total):
        worst = float("nan")
    ok = ok_r and ok_a and ok_q and (e_gemm < GEMM_TOL) and (worst < LAYER_TOL)  # NaN compares False
    active = int(torch.unique(dbg["topk_ids"]).numel())
    return dict(ok=ok, rel_err=worst, routed_rel_err=e_routed, total_rel_err=e_total,
                router_ok=ok_r, align_ok=ok_a, quant_ok=ok_q, gemm_rel_err=e_gemm,
                notes=msgs, active=active, out=out)


def gemm_probe(device, gemm, cfgs, gen, T=37, ne=8, n=256, k=384, top=2):
    """Both kinds of FP8 GEMM call (w13-like: top_k rows per token; w2-like: one row per
    pair, routing weights applied) on small random data whose blocks and groups have their
    own powers of two (a wrong scale index is then far off), against float64 of the same FP8
    inputs. Returns [(cfg_str, w13 err, w2 err)]."""
    def pow2(*shape):
        return torch.exp2(torch.randint(-6, 7, shape, device=device, generator=gen).to(torch.float32))

    a1 = torch.randn(T, k, device=device, generator=gen) * pow2(T, k // BLOCK).repeat_interleave(BLOCK, dim=1)
    a2 = torch.randn(T * top, n, device=device, generator=gen) * pow2(T * top, n // BLOCK).repeat_interleave(BLOCK, dim=1)
    b1 = torch.randn(ne, n, k, device=device, generator=gen) * 0.02 * pow2(ne, n // BLOCK, k // BLOCK).repeat_interleave(
        BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    b2 = torch.randn(ne, n, n, device=device, generator=gen) * 0.02 * pow2(ne, n // BLOCK, n // BLOCK).repeat_interleave(
        BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    a1q, a1s = act_quant(a1.to(torch.bfloat16).contiguous())
    a2q, a2s = act_quant(a2.to(torch.bfloat16).contiguous())
    b1q, b1s = quant_experts(b1)
    b2q, b2s = quant_experts(b2)
    ids = torch.rand(T, ne, device=device, generator=gen).topk(top, dim=-1).indices.to(torch.int32).contiguous()
    w = torch.rand(T, top, device=device, generator=gen).contiguous()
    flat = ids.reshape(-1).long()
    tok = torch.arange(T, device=device).repeat_interleave(top)
    pair = torch.arange(T * top, device=device)
    out = []
    for cfg in cfgs:
        sorted_ids, expert_ids, ntp = tfm.align_torch(ids, cfg["BLOCK_SIZE_M"], ne)
        c1 = torch.full((T * top, n), float("nan"), device=device, dtype=torch.bfloat16)
        c2 = torch.full((T * top, n), float("nan"), device=device, dtype=torch.bfloat16)
        gemm(a1q, a1s, b1q, b1s, c1, w, sorted_ids, expert_ids, ntp, top, False, cfg)
        gemm(a2q, a2s, b2q, b2s, c2, w, sorted_ids, expert_ids, ntp, 1, True, cfg)
        if c1.is_cuda:
            torch.cuda.synchronize()
        out.append((tfm.cfg_str(cfg), gemm_rel_err(a1q, a1s, b1q, b1s, c1, tok, flat),
                    gemm_rel_err(a2q, a2s, b2q, b2s, c2, pair, flat, w.reshape(-1).double())))
    return out


def preflight_fp8(device):
    """The activation quantizer's Triton kernel against the torch one (torch if it fails, as
    the bf16 peer's helper stages), then the FP8 GEMM kernel on small data (no fallback: it
    is what is measured). Returns (notes, error or '')."""
    notes = []
    gen = torch.Generator(device=device)  # not the global generator: the weights' draw stays the bf16 peer's
    gen.manual_seed(4321)
    try:
        for T, C in ((37, 2048), (5, 7168)):
            y = torch.randn(T, C, device=device, generator=gen)
            y = y * torch.exp2(torch.randint(-20, 21, (T, C // BLOCK), device=device, generator=gen).to(
                torch.float32)).repeat_interleave(BLOCK, dim=1)
            y[0, :BLOCK] = 0.0  # an all-zero group: scale eps/448, codes 0
            y = y.to(torch.bfloat16).contiguous()
            qt, st = per_token_group_quant_fp8_triton(y)
            torch.cuda.synchronize()
            ok, es, sl = check_act_quant(y, qt, st)
            qr, _ = per_token_group_quant_fp8_torch(y)
            same = (from_e4m3(qt) == from_e4m3(qr)).float().mean().item()
            if not (ok and same >= 0.999):
                raise RuntimeError("[%d, %d]: scale err %.1e, slack %.1e, %.5f of the codes equal to the torch "
                                   "quantizer's" % (T, C, es, sl, same))
        notes.append("quant: triton ok (scale err %.1e, slack %.1e, %.5f of the codes equal to torch's)" % (es, sl, same))
    except Exception as e:
        tfm.IMPL["quant"] = "torch"
        notes.append("quant: TRITON FAILED, using the torch quantizer: %s" % repr(e)[:300])
    try:
        res = gemm_probe(device, fp8_moe_gemm, [fp8_default_config(37), fp8_old_default_config(37)], gen)
        for c, e1, e2 in res:
            if not (e1 < GEMM_TOL and e2 < GEMM_TOL):
                return notes, "fp8 GEMM preflight [%s]: rel err w13-like %.3e, w2-like %.3e (tol %g)" % (c, e1, e2, GEMM_TOL)
        notes.append("fp8 GEMM: ok on small data (%s)" % "; ".join("%s %.1e/%.1e" % r for r in res))
    except Exception as e:
        return notes, "fp8 GEMM preflight: %s" % repr(e)[:400]
    return notes, ""


# --------------------------------------------------------------------------------------
# Wiring into the bf16 peer
# --------------------------------------------------------------------------------------


def _install():
    """Point the bf16 peer's lookups at the FP8 pieces."""
    tfm.routed_experts = routed_experts_fp8
    tfm.check_layer = check_layer_fp8
    tfm.bytes_floor_us = fp8_bytes_floor_us
    tfm.CONFIG_SOURCES = FP8_CONFIG_SOURCES
    tfm.TUNED_TABLES = FP8_TUNED_TABLES
    tfm.IMPL["quant"] = "triton" if HAVE_TRITON else "torch"


_install()


# --------------------------------------------------------------------------------------
# GPU harness (the bf16 peer's main_gpu with FP8's env line, floor, weights and summary)
# --------------------------------------------------------------------------------------


def measure_floor_bandwidth(device):
    """The copy bandwidth (bytes read + written per second) becomes the floor's."""
    gbps = tfm.measure_copy_gbps(device)
    FLOOR["bytes_per_s"] = gbps * 1e9
    FLOOR["source"] = "measured device-to-device copy, read + written"
    return gbps


def main_gpu(args):
    t_start = time.time()
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device visible to torch", flush=True)
        return 2
    if not HAVE_TRITON:
        print("FAIL: triton does not import: %s" % tfm.TRITON_IMPORT_ERROR, flush=True)
        return 2
    device = torch.device(tfm.DEVICE)
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        print("FAIL: FP8 tl.dot needs compute capability 8.9 or newer, this device has %d.%d" % cc, flush=True)
        return 2
    tfm.apply_preset(args.preset)
    why = check_fp8_shape()
    if why:
        print("FAIL: preset %s: %s" % (args.preset, why), flush=True)
        return 2
    tfm.ROUTER_CHOICE = args.router
    tfm.IMPL.update(router="triton", align="triton", act="triton", quant="triton")
    torch.manual_seed(0)
    if args.configs is None:  # the tuned table only where vLLM ships one
        cfg_req = "default" if tfm.config_unavailable("tuned") else "default,tuned"
    else:
        cfg_req = args.configs
    cfg_names = [c.strip() for c in cfg_req.split(",") if c.strip()]
    props = torch.cuda.get_device_properties(device)
    env = {
        "device": torch.cuda.get_device_name(device),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "dtype": DTYPE_TAG,
        "quant": ("fp8_w8a8, block_shape=[128,128]: routed experts' weights E4M3 with a float32 scale_inv per "
                  "128x128 block (gpuctx's quantizer), activations E4M3 per token per 128 columns"),
        "shared_expert": "bf16 (its FP8 values)" if tfm.IS else "none",
        "tuned_table": tuned_table_desc(),
        "default_config": "vLLM get_default_config, fp8_w8a8 + block_shape branch (after PR #34846)",
        "configs": cfg_names,
    }
    print("env: " + json.dumps(env), flush=True)
    env["preset"] = tfm.PRESET["name"]
    env["preset_shape"] = {k: tfm.PRESET[k] for k in ("model", "H", "E", "K", "I", "IS", "shared_gate", "scoring",
                                                      "n_group", "topk_group", "renorm", "scale")}
    print("preset %s (%s): %s; routing %s" % (tfm.PRESET["name"], tfm.PRESET["model"], tfm.shape_str(),
                                            json.dumps(env["preset_shape"])), flush=True)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    for c in cfg_names:
        if c not in tfm.CONFIG_SOURCES:
            print("FAIL: unknown config %r (known: %s)" % (c, ", ".join(tfm.CONFIG_SOURCES)), flush=True)
            return 2
    skipped = {c: tfm.config_unavailable(c) for c in cfg_names if tfm.config_unavailable(c)}
    for c, why in skipped.items():
        print("config %s dropped: %s" % (c, why), flush=True)
    cfg_names = [c for c in cfg_names if c not in skipped]
    if skipped:
        env["configs_dropped"] = skipped
    if not cfg_names:
        print("FAIL: no config left to run", flush=True)
        return 2
    print("tuned table: %s" % tuned_table_desc(), flush=True)
    for T in tokens:
        print("T=%d configs: %s" % (T, ", ".join(
            "%s %s" % (c, tfm.cfg_str(tfm.CONFIG_SOURCES[c](T))) for c in cfg_names)), flush=True)

    with torch.no_grad():
        notes = tfm.preflight(device)
        notes8, err = preflight_fp8(device)
        for nline in notes + notes8:
            print("preflight: " + nline, flush=True)
        if err:
            print("FAIL: %s" % err, flush=True)
            return 2
        try:
            env["copy_GBps"] = round(measure_floor_bandwidth(device), 1)
            print("measured device copy: %.0f GB/s (floor uses %.2e B/s)" % (
                env["copy_GBps"], FLOOR["bytes_per_s"]), flush=True)
        except Exception as e:
            print("copy bandwidth not measured: %r (floor uses %.2e B/s)" % (e, FLOOR["bytes_per_s"]), flush=True)
        env["floor_bytes_per_s"] = FLOOR["bytes_per_s"]
        env["floor_bandwidth"] = FLOOR["source"]

        set_bytes = fp8_set_bytes()
        draw_bytes = tfm.weight_set_bytes()  # the bf16 draw each set is quantized from
        n_sets = max(1, args.sets if args.sets is not None else tfm.PRESET["sets"])
        free, _ = torch.cuda.mem_get_info()
        while n_sets > 1 and n_sets * set_bytes + draw_bytes > 0.6 * free:
            n_sets -= 1
        sets = []
        for _ in range(n_sets):
            sets.append(make_weights_fp8(device))
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        env["weight_sets"] = n_sets
        env["weight_set_GB"] = round(set_bytes / 1e9, 3)
        print("weights: %d set(s) of %.2f GB (rotated to defeat L2): routed experts FP8 (%.3f GB of codes and "
              "block scales each), the rest bf16" % (n_sets, set_bytes / 1e9, fp8_expert_bytes() * tfm.E / 1e9),
              flush=True)
        side = torch.cuda.Stream()

        rows = []
        dead = None
        for T in tokens:
            if dead:
                row = {"tokens": T, "preset": tfm.PRESET["name"], "floor_us": None, "eager_us": None,
                       "graph_us": None, "graph_dual_us": None, "rel_err": None, "ok": False,
                       "errors": ["skipped: CUDA context unusable after: " + dead]}
            else:
                try:
                    row = tfm.run_tokens(T, sets, cfg_names, side, args.warmup, args.iters, device)
                except Exception as e:
                    tb = traceback.format_exc(limit=4)
                    row = {"tokens": T, "preset": tfm.PRESET["name"], "floor_us": None, "eager_us": None,
                           "graph_us": None, "graph_dual_us": None, "rel_err": None, "ok": False,
                           "router": tfm.router_desc(), "errors": [repr(e)[:400]]}
                    print("  T=%d EXCEPTION:\n%s" % (T, tb), flush=True)
                    try:
                        torch.cuda.synchronize()
                    except Exception as e2:
                        dead = repr(e2)[:200]
            row["dtype"] = DTYPE_TAG
            bad_other = [c for c in cfg_names[1:] if row.get("ok_" + c) is False]
            if not row.get("ok") or bad_other:
                print("FAIL T=%d%s: %s" % (
                    T, "" if not row.get("ok") else " (config %s only)" % ",".join(bad_other),
                    "; ".join(row.get("errors", [])) or
                    "layer rel err %s >= %g, or a GEMM (%g), act quant, router or align check failed" % (
                        row.get("rel_err"), LAYER_TOL, GEMM_TOL)), flush=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not dead:
                try:
                    torch.cuda.empty_cache()
                except Exception:
                    pass

    env["seconds_total"] = round(time.time() - t_start, 1)
    env["impl"] = dict(tfm.IMPL)
    env["router"] = tfm.router_desc()
    env["configs"] = cfg_names
    out_dir = os.environ.get("OUT")
    if out_dir:
        try:
            with open(os.path.join(out_dir, ANCHOR_JSON), "w") as f:
                json.dump({"env": env, "rows": rows}, f, indent=1)
        except Exception as e:
            print("could not write $OUT json: %r" % (e,), flush=True)

    other = cfg_names[1:]
    print("", flush=True)
    print("vLLM-style Triton fused MoE anchor, FP8 w8a8 (block 128x128), %s layer (%s), preset %s, %s" % (
        tfm.PRESET["model"], tfm.shape_str(), tfm.PRESET["name"], env["device"]), flush=True)
    print("times in us, median of %d after %d warm-ups, %d weight set(s) rotated; primary config: %s; %s" % (
        args.iters, args.warmup, env.get("weight_sets", 0), cfg_names[0], tfm.impl_tag()), flush=True)
    print("router: %s; tuned table: %s" % (tfm.router_desc(), tuned_table_desc()), flush=True)
    hdr = "%6s %5s %8s %8s %8s %8s %8s" % ("T", "act", "floor", "eager", "graph", "g-dual", "cflops")
    for name in other:
        hdr += " %9s" % ("g-" + name)[:9]
    hdr += " %7s %9s %s" % ("fl/gr", "rel_err", "status")
    print(hdr, flush=True)
    n_fail = 0
    for r in rows:
        line = "%6d %5s %8s %8s %8s %8s %8s" % (
            r["tokens"], tfm.fmt(r.get("active_experts"), 1), tfm.fmt(r.get("floor_us")), tfm.fmt(r.get("eager_us")),
            tfm.fmt(r.get("graph_us")), tfm.fmt(r.get("graph_dual_us")), tfm.fmt(r.get("compute_floor_us")))
        for name in other:
            line += " %9s" % tfm.fmt(r.get("graph_%s_us" % name))
        rel = r.get("rel_err")
        bad_other = [name for name in other if r.get("ok_" + name) is False]
        status = "ok" if r.get("ok") else "FAIL"
        if bad_other:
            status += " (FAIL: %s)" % ",".join(bad_other)
        line += " %7s %9s %s" % (tfm.fmt(r.get("floor_over_graph"), 2),
                                 ("%.2e" % rel) if isinstance(rel, float) else "-", status)
        if not r.get("ok"):
            n_fail += 1
        print(line, flush=True)
    for r in rows:
        print("  T=%d cfg %s%s" % (r["tokens"], r.get("cfg", "-"), "".join(
            "; %s %s" % (name, r.get("cfg_" + name, "-")) for name in other)), flush=True)
    print("floor = bytes floor (FP8 codes + block scales of the experts touched, bf16 router and shared expert) at "
          "%.2f TB/s (%s); cflops = bf16 FLOP floor at %.0f TFLOP/s; fl/gr = floor / graph; rel_err = layer "
          "max|d|/max|ref| vs float64 from the dequantized weights (tol %g)" % (
              FLOOR["bytes_per_s"] / 1e12, FLOOR["source"], tfm.BF16_FLOPS_PER_S / 1e12, LAYER_TOL), flush=True)
    n_other = sum(1 for r in rows for name in other if r.get("ok_" + name) is False)
    print("%s: primary config failed at %d of %d token counts; other configs failed %d time(s); %.0f s total" % (
        "FAIL" if (n_fail or n_other) else "PASS", n_fail, len(rows), n_other, env["seconds_total"]), flush=True)
    return 1 if n_fail else 0


# --------------------------------------------------------------------------------------
# CPU self-test (torch on the CPU; no GPU, no Triton)
# --------------------------------------------------------------------------------------


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _e4m3_ref(f: float) -> int:
    """gpuctx's fp8.E4M3 (moe/fp8/e4m3.go), bit for bit: nearest even, saturating."""
    b = struct.unpack("<I", struct.pack("<f", f))[0]
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7F
    if a >= 0x43E00000:
        return sign | 0x7E
    if a < 0x3C800000:
        m = round(struct.unpack("<f", struct.pack("<I", a))[0] * 512)  # round(): ties to even
        return sign | m
    r = a + 0x7FFFF + ((a >> 20) & 1)
    e = (r >> 23) - 120
    return sign | ((e << 3) & 0xFF) | ((r >> 20) & 7)


def _e4m3_value(c: int) -> float:
    """gpuctx's decodeE4M3."""
    e, m = (c >> 3) & 15, c & 7
    if e == 15 and m == 7:
        v = float("nan")
    elif e == 0:
        v = math.ldexp(m, -9)
    else:
        v = math.ldexp(8 + m, e - 10)
    return -v if c & 0x80 else v


def _quantize_ref(w, rows, cols):
    """gpuctx's fp8.Quantize on a row-major list of float32 values: (codes, scales)."""
    rb, cb = tfm.cdiv(rows, BLOCK), tfm.cdiv(cols, BLOCK)
    codes, scales = [0] * (rows * cols), [0.0] * (rb * cb)
    for br in range(rb):
        for bc in range(cb):
            r0, r1, c0, c1 = br * BLOCK, min((br + 1) * BLOCK, rows), bc * BLOCK, min((bc + 1) * BLOCK, cols)
            amax = max(abs(w[i * cols + j]) for i in range(r0, r1) for j in range(c0, c1))
            s = _f32(max(amax, _f32(SCALE_EPS)) / FP8_MAX)
            scales[br * cb + bc] = s
            for i in range(r0, r1):
                for j in range(c0, c1):
                    codes[i * cols + j] = _e4m3_ref(_f32(w[i * cols + j] / s))
    return codes, scales


def _bf16_bits_ref(f: float) -> int:
    """gpuctx's half.BF16 of a float32 value (no NaN here)."""
    b = struct.unpack("<I", struct.pack("<f", f))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _emulate_fp8_moe_gemm(A, A_scale, B, B_scale, C, topk_w, sorted_ids, expert_ids, ntp, top_k, mul_routed_weight, cfg):
    """Torch emulation of fused_moe_kernel_fp8_block's grid and indexing (float64 math, the
    BLOCK_SIZE_K steps and their scale indices as the kernel takes them)."""
    bm, bn, gm = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["GROUP_SIZE_M"]
    bk = min(cfg["BLOCK_SIZE_K"], min(BLOCK_SHAPE))
    group_n, group_k = BLOCK_SHAPE
    assert tfm.cdiv(B.size(-2), group_n) == B_scale.size(-2) and tfm.cdiv(B.size(-1), group_k) == B_scale.size(-1)
    em = sorted_ids.shape[0]
    if A.shape[0] < bm:
        em = min(em, A.shape[0] * top_k * bm)
    n, k = B.shape[1], B.shape[2]
    num_pid_m, num_pid_n = tfm.cdiv(em, bm), tfm.cdiv(n, bn)
    total = int(ntp.reshape(-1)[0])
    num_valid = A.shape[0] * top_k
    Af, As = from_e4m3(A).double(), A_scale.double()
    Bs = B_scale.double()
    flat_w = topk_w.reshape(-1).double()
    seen = set()
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
        Bf = from_e4m3(B[e]).double()
        cols = torch.arange(pid_n * bn, (pid_n + 1) * bn)
        bcols = cols % n
        rows = pair[ok] // top_k
        acc = torch.zeros(rows.numel(), bn, dtype=torch.float64)
        for kb in range(tfm.cdiv(k, bk)):
            k0, k1 = kb * bk, min((kb + 1) * bk, k)
            ks = k0 // group_k
            acc += (Af[rows, k0:k1] @ Bf[bcols, k0:k1].t()) * As[rows, ks][:, None] * Bs[e][bcols // group_n, ks][None, :]
        if mul_routed_weight:
            acc = acc * flat_w[pair[ok]][:, None]
        cm = cols < n
        C[pair[ok][:, None], cols[cm][None, :]] = acc[:, cm].to(C.dtype)
    assert len(seen) == num_pid_m * num_pid_n, "grouped pid mapping is not a bijection"


def cpu_selftest():
    saved = dict(tfm.IMPL)
    try:
        return _cpu_selftest()
    finally:
        tfm.IMPL = saved
        tfm.apply_preset(tfm.DEFAULT_PRESET)


def _cpu_selftest():
    tfm.IMPL = {"router": "torch", "align": "torch", "act": "torch", "quant": "torch"}
    tfm.apply_preset(tfm.DEFAULT_PRESET)
    torch.manual_seed(0)
    fails = 0

    def report(name, ok, msg=""):
        nonlocal fails
        fails += 0 if ok else 1
        print("%s %s %s" % ("ok  " if ok else "FAIL", name, msg), flush=True)

    # 1. configs: vLLM's block-FP8 default, the tuned table and where it applies
    for M, w in {1: (16, 128, 128, 1, 4, 3), 16: (16, 128, 128, 1, 4, 3), 17: (16, 128, 128, 32, 4, 3),
                 64: (16, 128, 128, 32, 4, 3), 65: (64, 128, 128, 32, 4, 3), 4096: (64, 128, 128, 32, 4, 3)}.items():
        c = fp8_default_config(M)
        got = tuple(c[k] for k in tfm._CFG_KEYS)
        report("fp8 default config M=%d" % M, got == w and set(c) == set(tfm._CFG_KEYS), str(got))
    table = FP8_TUNED_TABLES[(128, 768)]
    report("tuned table size", len(table) == 18 and all(set(v) == set(tfm._CFG_KEYS) for v in table.values()),
           str(len(table)))
    want = {1: (64, 64, 128, 1, 4, 3), 2: (64, 128, 128, 32, 4, 4), 8: (16, 128, 128, 16, 4, 5),
            64: (16, 128, 128, 16, 4, 3), 256: (64, 128, 128, 16, 4, 4), 4096: (64, 128, 128, 16, 4, 4)}
    for m, w in want.items():
        got = tuple(table[m][k] for k in tfm._CFG_KEYS)
        report("tuned table entry %d" % m, got == w, str(got))
    for name in tfm.PRESETS:
        tfm.apply_preset(name)
        why = tfm.config_unavailable("tuned")
        shipped = (tfm.E, tfm.I) in FP8_TUNED_TABLES
        report("tuned table %s for %s (E=%d,N=%d)" % ("used" if shipped else "absent", name, tfm.E, tfm.I),
               (name == "qwen3-30b-a3b") == shipped and (why == "") == shipped, tuned_table_desc())
        report("%s runs in block FP8" % name, check_fp8_shape() == "", check_fp8_shape())
        if shipped:
            report("tuned M=3 -> key 2 (nearest, first of a tie)", tfm.tuned_config(3) == table[2])
            report("tuned M=1000 -> key 1024", tfm.tuned_config(1000) == table[1024])
            report("tuned M=20000 -> key 4096", tfm.tuned_config(20000) == table[4096])
            report("CONFIG_SOURCES tuned is the table", tfm.CONFIG_SOURCES["tuned"](64) == table[64])
        report("CONFIG_SOURCES default for %s" % name, tfm.CONFIG_SOURCES["default"](8) == fp8_default_config(8))
    tfm.apply_preset(tfm.DEFAULT_PRESET)
    report("bf16 peer patched", tfm.routed_experts is routed_experts_fp8 and tfm.check_layer is check_layer_fp8
           and tfm.bytes_floor_us is fp8_bytes_floor_us and tfm.TUNED_TABLES is FP8_TUNED_TABLES)

    # 2. E4M3: torch's cast (what every quantizer here uses) against gpuctx's rule, bit for bit
    vals = set()
    for c in range(256):
        v = _e4m3_value(c)
        if not math.isnan(v):
            vals.add(v)
    for a, b in zip(sorted(vals), sorted(vals)[1:]):  # midpoints: ties to even
        vals.add(_f32((a + b) / 2))
        vals.add(_f32(math.nextafter((a + b) / 2, a)))
        vals.add(_f32(math.nextafter((a + b) / 2, b)))
    rnd = __import__("random").Random(5)
    for _ in range(4000):
        vals.add(_f32(math.copysign(rnd.uniform(0, 448) * 2.0 ** -rnd.randint(0, 30), rnd.random() - 0.5)))
    vals = [v for v in vals if abs(v) <= FP8_MAX]
    got = codes_u8(to_e4m3(torch.tensor(vals, dtype=torch.float32))).tolist()
    bad = [(v, g, _e4m3_ref(v)) for v, g in zip(vals, got) if g != _e4m3_ref(v)]
    report("E4M3 cast == gpuctx's fp8.E4M3 on %d values (all codes, midpoints, random)" % len(vals), not bad, str(bad[:3]))
    back = from_e4m3(as_fp8(torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8))).tolist()
    report("E4M3 decode == gpuctx's", all(v == _e4m3_value(c) for v, c in zip(back, [c for c in range(256) if c & 0x7F != 0x7F])))

    # 3. the weight quantizer against gpuctx's Quantize (partial blocks, a zero block, wide scales)
    gen = torch.Generator().manual_seed(11)
    for R, C in ((3, 5), (130, 260), (256, 128)):
        w = torch.randn(R, C, generator=gen) * torch.exp2(torch.randint(-12, 4, (R, 1), generator=gen).float())
        if R >= BLOCK:
            w[:BLOCK, :BLOCK] = 0.0
        q, s = quant_weight_blocks(w.to(torch.bfloat16))
        wl = w.to(torch.bfloat16).float().reshape(-1).tolist()
        rc, rs = _quantize_ref(wl, R, C)
        same_c = codes_u8(q).reshape(-1).tolist() == rc
        same_s = s.reshape(-1).tolist() == rs
        report("weight quantizer == gpuctx's fp8.Quantize [%d, %d]" % (R, C),
               same_c and same_s and tuple(s.shape) == (tfm.cdiv(R, BLOCK), tfm.cdiv(C, BLOCK)),
               "codes %s, scales %s" % ("equal" if same_c else "DIFFER", "equal" if same_s else "DIFFER"))
        d32 = dequant_weight(q, s, torch.float32).reshape(-1).tolist()
        sc = lambda i: rs[(i // C // BLOCK) * tfm.cdiv(C, BLOCK) + (i % C) // BLOCK]  # noqa: E731
        report("dequant float32 == code * scale_inv [%d, %d]" % (R, C),
               all(d32[i] == _f32(_e4m3_value(rc[i]) * sc(i)) for i in range(R * C)))
        rt = fp8_round_trip(w.to(torch.bfloat16)).view(torch.int16).reshape(-1).tolist()
        report("shared expert round trip == bf16(code * scale_inv) [%d, %d]" % (R, C),
               all((rt[i] & 0xFFFF) == _bf16_bits_ref(_f32(_e4m3_value(rc[i]) * sc(i))) for i in range(R * C)))
    w = torch.randn(2, 2 * 256, 384, generator=gen).to(torch.bfloat16)
    q, s = quant_experts(w, parts=2)
    q1, s1 = quant_weight_blocks(w[1, 256:])
    report("quant_experts: gate and up on their own", tuple(s.shape) == (2, 4, 3) and torch.equal(
        codes_u8(q[1, 256:]), codes_u8(q1)) and torch.equal(s[1, 2:], s1))

    # 4. the activation quantizer against gpuctx's QuantizeActivations (vLLM's rule)
    x = (torch.randn(9, 384, generator=gen) * torch.exp2(torch.randint(-20, 20, (9, 3), generator=gen).float()
                                                         ).repeat_interleave(BLOCK, dim=1)).to(torch.bfloat16)
    x[2, 128:256] = 0.0
    xq, xs = per_token_group_quant_fp8_torch(x)
    ok_all = True
    xl = x.float().tolist()
    for t in range(9):
        for gi in range(3):
            grp = xl[t][gi * BLOCK:(gi + 1) * BLOCK]
            sref = _f32(max(max(abs(v) for v in grp), _f32(SCALE_EPS)) / FP8_MAX)
            cref = [_e4m3_ref(_f32(v / sref)) for v in grp]
            ok_all &= xs[t, gi].item() == sref and codes_u8(xq[t, gi * BLOCK:(gi + 1) * BLOCK]).tolist() == cref
    ok_chk, es, sl = check_act_quant(x, xq, xs)
    report("act quantizer == gpuctx's fp8.QuantizeActivations", ok_all and tuple(xs.shape) == (9, 3))
    report("check_act_quant accepts it", ok_chk, "scale err %.1e, slack %.1e" % (es, sl))
    ok_chk, _, _ = check_act_quant(x, xq, xs * 1.01)
    report("check_act_quant rejects scales 1% off", not ok_chk)
    bad_q = codes_u8(xq).clone()
    bad_q[4, 7] = bad_q[4, 7] ^ 0x02
    ok_chk, _, sl = check_act_quant(x, as_fp8(bad_q), xs)
    report("check_act_quant rejects a code two steps off", not ok_chk, "slack %.1e" % sl)

    # 5. the FP8 GEMM's indexing (emulated) on the preflight's data, and the check's teeth
    for c, e1, e2 in gemm_probe("cpu", _emulate_fp8_moe_gemm, [fp8_default_config(37), fp8_old_default_config(37),
                                                                   dict(fp8_default_config(37), BLOCK_SIZE_K=64,
                                                                        BLOCK_SIZE_N=64, GROUP_SIZE_M=2)],
                                torch.Generator().manual_seed(3)):
        report("fp8 GEMM probe (emulated) %s" % c, e1 < 1e-2 and e2 < 1e-2, "w13-like %.1e, w2-like %.1e" % (e1, e2))

    def swapped_scale_gemm(A, A_scale, B, B_scale, *rest):
        return _emulate_fp8_moe_gemm(A, A_scale, B, B_scale.flip(1).contiguous(), *rest)

    res = gemm_probe("cpu", swapped_scale_gemm, [fp8_default_config(37)], torch.Generator().manual_seed(3))
    report("gemm_rel_err catches wrong block scales", res[0][1] > GEMM_TOL and res[0][2] > GEMM_TOL,
           "w13-like %.1e, w2-like %.1e" % res[0][1:])

    # 6. every preset's whole layer at tiny shapes through the bf16 peer's moe_layer with the
    # emulated GEMM: check_layer_fp8 (the GPU path's check) passes, and fails when broken
    tiny = {"deepseek-v2-lite": dict(H=256, E=8, K=3, I=128, IS=256),
            "qwen1.5-moe": dict(H=256, E=12, K=4, I=128, IS=384),
            "qwen3-30b-a3b": dict(H=256, E=16, K=4, I=128, IS=0),
            "deepseek-v3": dict(H=256, E=64, K=8, I=128, IS=128)}
    torch.manual_seed(3)
    try:
        for name, shp in tiny.items():
            tfm.apply_preset(name, **shp)
            Wt = make_weights_fp8("cpu")
            keys = ",".join(sorted(Wt))
            report("weights %s tiny [%s]" % (name, keys),
                   Wt["w13"].dtype == FP8_DTYPE and tuple(Wt["w13_s"].shape) == (tfm.E, 2 * tfm.I // BLOCK, tfm.H // BLOCK)
                   and tuple(Wt["w2_s"].shape) == (tfm.E, tfm.H // BLOCK, tfm.I // BLOCK)
                   and Wt["wg"].dtype == torch.bfloat16 and ("ws13" in Wt) == bool(tfm.IS)
                   and (tfm.IS == 0 or Wt["ws13"].dtype == torch.bfloat16))
            for (T, bm, gm) in [(1, 16, 1), (7, 16, 2), (40, 64, 4)]:
                x = torch.randn(T, tfm.H).to(torch.bfloat16)
                cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": gm,
                       "num_warps": 4, "num_stages": 3}
                chk = check_layer_fp8(x, Wt, cfg, None, gemm=_emulate_fp8_moe_gemm)
                report("layer %s tiny T=%d BM=%d G=%d" % (name, T, bm, gm),
                       chk["ok"] and chk["gemm_rel_err"] < 1e-2 and 5e-3 < chk["rel_err"] < LAYER_TOL,
                       "layer rel %.1e (routed %.1e), GEMMs %.1e; %s" % (
                           chk["rel_err"], chk["routed_rel_err"], chk["gemm_rel_err"], "; ".join(chk["notes"])))
            # a GEMM that takes every K block's activation scale from the first group, and one
            # whose output is 25% high, must fail the check (the GEMM checks; the layer check
            # too for the latter). A misplaced weight scale cannot show on these weights: every
            # block of N(0, 0.02^2) draws has nearly the same amax; the preflight's gemm_probe
            # (a power of two per block) is what checks that indexing.
            x = torch.randn(9, tfm.H).to(torch.bfloat16)
            cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                   "num_warps": 4, "num_stages": 3}

            def first_group_scale(A, A_scale, *rest):
                return _emulate_fp8_moe_gemm(A, A_scale[:, :1].expand_as(A_scale).contiguous(), *rest)

            def high_output(A, A_scale, B, B_scale, C, *rest):
                _emulate_fp8_moe_gemm(A, A_scale, B, B_scale, C, *rest)
                C.mul_(1.25)

            for what, g, layer_too in (("the first group's activation scale", first_group_scale, False),
                                       ("its output 25% high", high_output, True)):
                chk = check_layer_fp8(x, Wt, cfg, None, gemm=g)
                report("%s: the check fails with a GEMM using %s" % (name, what),
                       not chk["ok"] and chk["gemm_rel_err"] > GEMM_TOL and (chk["rel_err"] > LAYER_TOL or not layer_too),
                       "GEMMs %.1e, layer %.1e" % (chk["gemm_rel_err"], chk["rel_err"]))
    finally:
        tfm.apply_preset(tfm.DEFAULT_PRESET)

    # 7. bytes and floors (gpuctx's WeightBytes for an FP8 layer: codes + block scales per expert)
    for name in tfm.PRESETS:
        tfm.apply_preset(name)
        bh, bi = tfm.cdiv(tfm.H, BLOCK), tfm.cdiv(tfm.I, BLOCK)
        per = 3 * tfm.H * tfm.I + 3 * bh * bi * 4
        dense = tfm.E * tfm.H * 2 + 3 * tfm.H * tfm.IS * 2 + (tfm.H * 2 if tfm.PRESET["shared_gate"] else 0) + (
            tfm.E * 4 if tfm.has_bias() else 0)
        FLOOR["bytes_per_s"] = 4.0e12
        ok = fp8_expert_bytes() == per and fp8_set_bytes() == tfm.E * per + dense and abs(
            fp8_bytes_floor_us(tfm.TOPK) - (tfm.TOPK * per + dense) / 4.0e12 * 1e6) < 1e-9
        report("sizes %s" % name, ok, "%.3f GB a weight set in FP8 (bf16: %.3f); floor %.1f us for %d experts, %.1f "
               "for all %d at 4 TB/s" % (fp8_set_bytes() / 1e9, tfm.weight_set_bytes() / 1e9,
                                         fp8_bytes_floor_us(tfm.TOPK), tfm.TOPK, fp8_bytes_floor_us(tfm.E), tfm.E))
    FLOOR["bytes_per_s"] = tfm.HBM_BYTES_PER_S
    tfm.apply_preset(tfm.DEFAULT_PRESET)
    print("%s: cpu self-test, %d failure(s)" % ("FAIL" if fails else "PASS", fails), flush=True)
    return 1 if fails else 0


def parse_args(argv):
    """The bf16 peer's command line (same flags, same ANCHOR_* defaults)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=list(tfm.PRESETS), default=os.environ.get("ANCHOR_PRESET", tfm.DEFAULT_PRESET),
                    help="layer shape and routing (default %s)" % tfm.DEFAULT_PRESET)
    ap.add_argument("--tokens", default=os.environ.get("ANCHOR_TOKENS", ",".join(map(str, tfm.DEFAULT_TOKENS))))
    ap.add_argument("--configs", default=os.environ.get("ANCHOR_CONFIGS"),
                    help="comma list from: %s; the first is the primary (graph_us etc.); default: default,tuned "
                         "where vLLM ships a tuned H200 fp8_w8a8 block table for the shape (qwen3-30b-a3b), "
                         "else default" % ", ".join(FP8_CONFIG_SOURCES))
    ap.add_argument("--iters", type=int, default=int(os.environ.get("ANCHOR_ITERS", "50")))
    ap.add_argument("--warmup", type=int, default=int(os.environ.get("ANCHOR_WARMUP", "10")))
    ap.add_argument("--sets", type=int,
                    default=int(os.environ["ANCHOR_SETS"]) if os.environ.get("ANCHOR_SETS") else None,
                    help="weight/input sets rotated to defeat L2 (default: 3; 2 for deepseek-v3)")
    ap.add_argument("--router", choices=("auto", "torch"), default=os.environ.get("ANCHOR_ROUTER", "auto"),
                    help="auto: the Triton router kernel, torch ops if it fails its preflight; "
                         "torch: torch ops always")
    ap.add_argument("--cpu-selftest", action="store_true", help="test the torch parts on the CPU and exit")
    return ap.parse_args(argv)


if __name__ == "__main__":
    _args = parse_args(sys.argv[1:])
    if _args.cpu_selftest:
        sys.exit(cpu_selftest())
    sys.exit(main_gpu(_args))
