"""Where Gemma 4 MoE's compiled decoder layers turn non-finite in bf16 on a GPU (call 12: the first step's gradient
norm NaN at 8 layers of its widths under sft/train.py). One packed row of two rows' samples (8,192 tokens, as a
micro batch of 2 in padding-free training), eager and compiled layers from the same weights, per experts
implementation: each layer's output and the gradient reaching it finite or not, the largest difference to eager, and
the first parameters whose gradient is not finite. Usage: `python benchmarks/calls/compile_nan.py [family] [layers]
[experts...]`; one JSON file to $OUT."""

import json
import math
import os
import sys
import time

import torch

import benchmarks.architectures as bench
from sft.model import experts as sft_experts
from sft.model.attention import VARLEN, register_varlen
from sft.model.converters import compile_decoder_layers

register_varlen()
family = sys.argv[1] if len(sys.argv) > 1 else "gemma4_moe"
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
implementations = sys.argv[3:] or ["grouped_mm", sft_experts.NAME]
device = os.environ.get("DEVICE", "cuda")  # DEVICE=cpu TINY=1: the script's own check at the tests' widths
tiny = bool(os.environ.get("TINY"))
config = bench.config_for(family, layers, tiny)
lengths = [n for row in bench.rows(512 if tiny else 4096, seed=2, count=2) for n in row]
batch = bench.packed(lengths, device, seed=100)


def run(implementation: str, compiled: bool) -> dict:
    model = bench.build(config, device, torch.bfloat16)
    model.set_attn_implementation(VARLEN)
    model.set_experts_implementation(implementation)
    model.sft_router_load = sft_experts.RouterLoad(model)  # as sft/train.py's converters attach it
    if compiled:
        compile_decoder_layers(model)
    model.train()
    start = time.perf_counter()
    out = model(**batch, output_hidden_states=True)
    hidden = out.hidden_states
    for h in hidden:
        h.retain_grad()
    out.loss.backward()
    torch.cuda.synchronize() if device == "cuda" else None
    grads = {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}
    norm = math.sqrt(sum(float(g.float().norm()) ** 2 for g in grads.values()))
    result = {
        "seconds": time.perf_counter() - start,
        "loss": float(out.loss),
        "grad_norm": norm,
        "layer_output_finite": [bool(torch.isfinite(h).all()) for h in hidden],
        "layer_grad_finite": [None if h.grad is None else bool(torch.isfinite(h.grad).all()) for h in hidden],
        "nonfinite_grads": [n for n, g in grads.items() if not torch.isfinite(g).all()][:12],
    }
    keep = {"hidden": [h.detach().float() for h in hidden], "grads": {n: g.float() for n, g in grads.items()}}
    del model, out, hidden
    torch.cuda.empty_cache() if device == "cuda" else None
    return result, keep


results = {"family": family, "layers": layers, "tokens": len(batch["input_ids"][0]), "samples": len(lengths)}
for implementation in implementations:
    try:
        eager, ref = run(implementation, False)
        compiled, got = run(implementation, True)
    except Exception as e:  # noqa: BLE001  (recorded: a failing implementation is a result)
        results[implementation] = {"error": f"{type(e).__name__}: {e}"[:600]}
        print(implementation, results[implementation], flush=True)
        continue
    pairs = zip(ref["hidden"], got["hidden"], strict=True)
    compiled["layer_output_diff"] = [float((a - b).abs().max()) for a, b in pairs]
    compiled["grad_rel_diff_max"] = max(
        float((ref["grads"][n] - got["grads"][n]).norm() / (ref["grads"][n].norm() + 1e-30)) for n in ref["grads"]
    )
    results[implementation] = {"eager": eager, "compiled": compiled}
    print(implementation, json.dumps(results[implementation]), flush=True)
    torch._dynamo.reset()
with open(os.path.join(os.environ.get("OUT", "."), f"compile_nan_{family}.json"), "w") as f:
    json.dump(results, f, indent=1)
