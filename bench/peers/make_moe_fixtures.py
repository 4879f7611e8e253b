#!/usr/bin/env python3
"""Write reference fixtures for gpuctx's moe package from the transformers MoE blocks.

For each family and routing variant this builds a tiny config, instantiates the
family's MoE block class from transformers with seeded random float32 weights,
runs it on x with 7 tokens and with 1 token, and writes into OUT/<name>/:

  config.json            the full config (num_hidden_layers 2, layer 1 is MoE)
  model.safetensors      the block's tensors under model.layers.1.mlp. with the
                         Hub's names (per-expert, fused, or Mixtral's
                         block_sparse_moe w1/w3/w2), F32 or BF16
  input.safetensors      x [7,H] and x_t1 [1,H], F32
  expected.safetensors   y, y_t1 [T,H] F32, and the block's routing:
                         topk_idx[_t1] I32 [T,K], topk_weight[_t1] F32 [T,K]
  meta.json              layer, class, layout, versions

Usage (GPU machine, no network; runs on CPU in float32 for exactness):
  python3 bench/peers/make_moe_fixtures.py --out "$OUT/moe-fixtures"
  tar -C "$OUT" -czf "$OUT/moe-fixtures.tgz" moe-fixtures
Then unpack into moe/testdata/ and run `go test ./moe -run Fixtures -v`.

Every problem is fatal: the script prints what it found and exits non-zero.
"""

import argparse
import json
import math
import os
import platform
import sys
import traceback

import torch

try:
    import transformers
    import safetensors
    from safetensors.torch import save_file
except Exception as e:  # noqa: BLE001
    sys.exit(f"FATAL: cannot import transformers/safetensors: {e!r}")

LAYER = 1
H, I = 64, 32
TOKENS = {"": 7, "_t1": 1}
MAX_TOTAL_BYTES = 2 * 1024 * 1024


def die(msg):
    print(f"FATAL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


# name, model_type, block class candidates, config fields, layout, on-disk dtype
FIXTURES = [
    dict(name="deepseek_v2_greedy", model_type="deepseek_v2", classes=["DeepseekV2Moe", "DeepseekV2MoE"],
         layout="per_expert", dtype="F32",
         cfg=dict(hidden_size=H, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=I,
                  n_shared_experts=2, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                  norm_topk_prob=False, routed_scaling_factor=1.5, first_k_dense_replace=0)),
    dict(name="deepseek_v2_group_fused_bf16", model_type="deepseek_v2", classes=["DeepseekV2Moe", "DeepseekV2MoE"],
         layout="fused", dtype="BF16",
         cfg=dict(hidden_size=H, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=I,
                  n_shared_experts=1, topk_method="group_limited_greedy", scoring_func="softmax", n_group=4,
                  topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0, first_k_dense_replace=0)),
    dict(name="deepseek_v3_noaux", model_type="deepseek_v3", classes=["DeepseekV3MoE", "DeepseekV3Moe"],
         layout="per_expert", dtype="F32", bias=True,
         cfg=dict(hidden_size=H, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=I,
                  n_shared_experts=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=4, topk_group=2,
                  norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=0)),
    dict(name="deepseek_v3_fused", model_type="deepseek_v3", classes=["DeepseekV3MoE", "DeepseekV3Moe"],
         layout="fused", dtype="F32", bias=True,
         cfg=dict(hidden_size=H, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=I,
                  n_shared_experts=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=4, topk_group=1,
                  norm_topk_prob=False, routed_scaling_factor=2.5, first_k_dense_replace=0)),
    dict(name="qwen2_moe_nonorm", model_type="qwen2_moe", classes=["Qwen2MoeSparseMoeBlock"],
         layout="per_expert", dtype="F32",
         cfg=dict(hidden_size=H, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=I,
                  shared_expert_intermediate_size=2 * I, norm_topk_prob=False, decoder_sparse_step=1,
                  mlp_only_layers=[], intermediate_size=2 * I)),
    dict(name="qwen2_moe_norm", model_type="qwen2_moe", classes=["Qwen2MoeSparseMoeBlock"],
         layout="per_expert", dtype="F32",
         cfg=dict(hidden_size=H, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=I,
                  shared_expert_intermediate_size=I, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], intermediate_size=2 * I)),
    dict(name="qwen3_moe", model_type="qwen3_moe", classes=["Qwen3MoeSparseMoeBlock"],
         layout="per_expert", dtype="F32",
         cfg=dict(hidden_size=H, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=I,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=2 * I)),
    dict(name="mixtral", model_type="mixtral", classes=["MixtralSparseMoeBlock"],
         layout="mixtral_hub", dtype="F32",
         cfg=dict(hidden_size=H, num_local_experts=8, num_experts_per_tok=2, intermediate_size=I)),
]

COMMON = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
              hidden_act="silu", max_position_embeddings=64)


def config_class(model_type):
    cls = transformers.CONFIG_MAPPING.get(model_type) if hasattr(transformers, "CONFIG_MAPPING") else None
    if cls is None:
        from transformers import AutoConfig
        return type(AutoConfig.for_model(model_type))
    return cls


def make_config(fx):
    cls = config_class(fx["model_type"])
    kwargs = dict(COMMON)
    kwargs.update(fx["cfg"])
    try:
        cfg = cls(**kwargs)
    except TypeError as e:
        # A strict config class: build it from the fields it knows, set the rest.
        print(f"  note: {cls.__name__}(**kwargs) raised {e!r}; setting unknown fields as attributes")
        import inspect
        known = set(inspect.signature(cls.__init__).parameters)
        cfg = cls(**{k: v for k, v in kwargs.items() if k in known})
        for k, v in kwargs.items():
            if k not in known:
                setattr(cfg, k, v)
    for k, v in fx["cfg"].items():
        got = getattr(cfg, k, None)
        if got != v:
            die(f"{fx['name']}: config field {k} is {got!r} after construction, want {v!r}")
    try:
        cfg._experts_implementation = "eager"
    except Exception as e:  # noqa: BLE001
        print(f"  note: cannot set _experts_implementation: {e!r}")
    return cfg


def block_class(fx):
    import importlib
    mod = importlib.import_module(f"transformers.models.{fx['model_type']}.modeling_{fx['model_type']}")
    for name in fx["classes"]:
        if hasattr(mod, name):
            return getattr(mod, name)
    moe_like = [n for n in dir(mod) if "moe" in n.lower() or "sparse" in n.lower()]
    die(f"{fx['name']}: none of {fx['classes']} in {mod.__name__}; candidates: {moe_like}")


def init_weights(block, gen, bias):
    for name, p in block.named_parameters():
        fan_in = p.shape[-1]
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            p.copy_((torch.rand(p.shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound)
    for name, b in block.named_buffers():
        if name.endswith("e_score_correction_bias"):
            if not bias:
                die(f"unexpected buffer {name}")
            with torch.no_grad():
                b.copy_((torch.rand(b.shape, generator=gen, dtype=torch.float32) * 2 - 1) * 0.3)


def hub_tensors(fx, cfg, sd):
    """Map the block's state_dict to checkpoint names under the layer prefix."""
    E = fx["cfg"].get("n_routed_experts") or fx["cfg"].get("num_experts") or fx["cfg"].get("num_local_experts")
    inter = fx["cfg"].get("moe_intermediate_size", fx["cfg"].get("intermediate_size"))
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in sd.items()}
    # Normalise the experts to per-expert gate/up/down [I,H],[I,H],[H,I].
    per = {}
    if "experts.gate_up_proj" in sd:
        gu, dp = sd.pop("experts.gate_up_proj"), sd.pop("experts.down_proj")
        if tuple(gu.shape) != (E, 2 * inter, H) or tuple(dp.shape) != (E, H, inter):
            die(f"{fx['name']}: fused experts have shapes {tuple(gu.shape)}, {tuple(dp.shape)}; "
                f"expected [E,2I,H]={(E, 2 * inter, H)} and [E,H,I]={(E, H, inter)} (layout changed?)")
        for e in range(E):
            per[e] = (gu[e, :inter], gu[e, inter:], dp[e])
    else:
        for e in range(E):
            try:
                if f"experts.{e}.gate_proj.weight" in sd:
                    per[e] = tuple(sd.pop(f"experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))
                else:
                    per[e] = tuple(sd.pop(f"experts.{e}.{n}.weight") for n in ("w1", "w3", "w2"))
            except KeyError as k:
                die(f"{fx['name']}: expert {e} tensor {k} missing; state_dict keys: {sorted(sd)}")
    out = {}
    if fx["layout"] == "mixtral_hub":
        prefix = f"model.layers.{LAYER}.block_sparse_moe."
        for e, (g, u, d) in per.items():
            out[f"experts.{e}.w1.weight"], out[f"experts.{e}.w3.weight"], out[f"experts.{e}.w2.weight"] = g, u, d
    elif fx["layout"] == "fused":
        prefix = f"model.layers.{LAYER}.mlp."
        out["experts.gate_up_proj"] = torch.stack([torch.cat([per[e][0], per[e][1]], 0) for e in range(E)])
        out["experts.down_proj"] = torch.stack([per[e][2] for e in range(E)])
    else:
        prefix = f"model.layers.{LAYER}.mlp."
        for e, (g, u, d) in per.items():
            out[f"experts.{e}.gate_proj.weight"], out[f"experts.{e}.up_proj.weight"], out[f"experts.{e}.down_proj.weight"] = g, u, d
    known = {"gate.weight", "gate.e_score_correction_bias", "shared_expert_gate.weight"}
    for k in list(sd):
        if k in known or k.startswith("shared_expert.") or k.startswith("shared_experts."):
            out[k] = sd.pop(k)
    if sd:
        die(f"{fx['name']}: state_dict has tensors this script does not know how to name: {sorted(sd)}")
    return {prefix + k: v for k, v in out.items()}, per


def run_block(block, x):
    captured = {}

    def pre_hook(mod, args, kwargs):
        a = list(args) + [kwargs.get(k) for k in ("top_k_index", "top_k_weights") if k in kwargs]
        if len(a) >= 3:
            captured["idx"], captured["w"] = a[1], a[2]

    handle = None
    experts = getattr(block, "experts", None)
    if isinstance(experts, torch.nn.Module) and not isinstance(experts, torch.nn.ModuleList):
        handle = experts.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            out = block(x.view(1, x.shape[0], x.shape[1]))
    finally:
        if handle is not None:
            handle.remove()
    if isinstance(out, tuple):
        out = out[0]
    y = out.reshape(x.shape[0], x.shape[1]).to(torch.float32)
    idx = w = None
    if "idx" in captured:
        idx = captured["idx"].reshape(x.shape[0], -1).to(torch.int64)
        w = captured["w"].to(torch.float32).reshape(x.shape[0], -1)
        if w.shape[1] != idx.shape[1]:  # dense [T,E] scores: gather the chosen ones
            w = w.gather(1, idx)
    return y, idx, w


def manual_forward(fx, cfg, tensors, per, x, idx, w):
    """Recompute the block from the tensors written, with the block's routing, in float64."""
    x64 = x.to(torch.float64)
    y = torch.zeros_like(x64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            g, u, d = (m.to(torch.float64) for m in per[int(idx[t, k])])
            a = torch.nn.functional.silu(g @ x64[t]) * (u @ x64[t])
            y[t] += float(w[t, k]) * (d @ a)
    prefix = f"model.layers.{LAYER}.mlp."
    for s in ("shared_experts", "shared_expert"):
        if prefix + s + ".gate_proj.weight" in tensors:
            g, u, d = (tensors[f"{prefix}{s}.{n}_proj.weight"].to(torch.float64) for n in ("gate", "up", "down"))
            sh = (torch.nn.functional.silu(x64 @ g.T) * (x64 @ u.T)) @ d.T
            if prefix + "shared_expert_gate.weight" in tensors:
                sh = sh * torch.sigmoid(x64 @ tensors[prefix + "shared_expert_gate.weight"].to(torch.float64).T)
            y += sh
    return y


def make(fx, out_dir, seed):
    print(f"== {fx['name']} ({fx['model_type']}, {fx['layout']}, {fx['dtype']})", flush=True)
    cfg = make_config(fx)
    cls = block_class(fx)
    block = cls(cfg).to(torch.float32).eval()
    notes = []
    if fx["cfg"].get("topk_method") == "group_limited_greedy" and not hasattr(block, "num_experts"):
        # transformers' DeepseekV2Moe reads self.num_experts in this branch but never sets it.
        block.num_experts = cfg.n_routed_experts
        notes.append("set block.num_experts = n_routed_experts (missing in DeepseekV2Moe)")
    gen = torch.Generator().manual_seed(seed)
    init_weights(block, gen, fx.get("bias", False))
    if fx["dtype"] == "BF16":
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    tensors, per = hub_tensors(fx, cfg, block.state_dict())
    inputs, expected = {}, {}
    K = fx["cfg"]["num_experts_per_tok"]
    for suffix, T in TOKENS.items():
        x = torch.randn(T, H, generator=gen, dtype=torch.float32)
        y, idx, w = run_block(block, x)
        if not torch.isfinite(y).all():
            die(f"{fx['name']}: non-finite output")
        inputs["x" + suffix] = x.contiguous()
        expected["y" + suffix] = y.contiguous()
        if idx is None:
            print("  warning: could not capture the routing (experts is not a fused module); fixture has y only")
        else:
            if idx.shape != (T, K):
                die(f"{fx['name']}: captured top-k indices have shape {tuple(idx.shape)}, want {(T, K)}")
            expected["topk_idx" + suffix] = idx.to(torch.int32).contiguous()
            expected["topk_weight" + suffix] = w.contiguous()
            ym = manual_forward(fx, cfg, tensors, per, x, idx, w)
            err = (ym - y.to(torch.float64)).abs().max().item() / max(y.abs().max().item(), 1e-30)
            print(f"  T={T}: self-check from written tensors: rel err {err:.2e}")
            if err > 1e-5:
                die(f"{fx['name']}: the tensors written do not reproduce the block's output (rel err {err:.2e}); "
                    "the layout assumption (gate rows first in gate_up_proj, [E,H,I] down) is wrong")
    d = os.path.join(out_dir, fx["name"])
    os.makedirs(d, exist_ok=True)
    cj = json.loads(cfg.to_json_string(use_diff=False))
    for k, v in fx["cfg"].items():
        cj[k] = v
    cj["model_type"] = fx["model_type"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
    disk = torch.bfloat16 if fx["dtype"] == "BF16" else torch.float32
    save_file({k: v.to(disk).contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})
    save_file(inputs, os.path.join(d, "input.safetensors"))
    save_file(expected, os.path.join(d, "expected.safetensors"))
    meta = dict(layer=LAYER, model_type=fx["model_type"], block_class=cls.__name__, layout=fx["layout"],
                dtype=fx["dtype"], tokens=list(TOKENS.values()), seed=seed, notes=notes,
                torch=torch.__version__, transformers=transformers.__version__,
                safetensors=safetensors.__version__, tensors=sorted(tensors))
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"  wrote {d}: {len(tensors)} tensors; block class {cls.__name__}; notes {notes}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (one subdirectory per fixture)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", default="", help="comma-separated fixture names")
    args = ap.parse_args()
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"safetensors {safetensors.__version__}", flush=True)
    if not transformers.__version__.startswith("5."):
        print(f"warning: transformers {transformers.__version__} is not 5.x; names and layouts may differ", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    failed = []
    for i, fx in enumerate(FIXTURES):
        if only and fx["name"] not in only:
            continue
        try:
            make(fx, args.out, args.seed + i)
        except SystemExit:
            failed.append(fx["name"])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed.append(fx["name"])
    total = 0
    for root, _, files in os.walk(args.out):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print(f"total fixture size: {total} bytes", flush=True)
    if total > MAX_TOTAL_BYTES:
        die(f"fixtures take {total} bytes, over the {MAX_TOTAL_BYTES}-byte budget")
    if failed:
        die(f"fixtures failed: {failed}")
    print("OK", flush=True)


if __name__ == "__main__":
    main()
