"""Gemma 4 (2 layers, its widths) eager against compiled decoder layers in-process, per step's loss, three ways: the
benchmark's rows (a new set of sample lengths each step), one set of lengths every step, and new lengths with
torch.compile's automatic dynamic shapes off (a static graph per shape). Prints one line per run; results to $OUT."""

import json
import os
import sys

import torch

import benchmarks.architectures as bench
from sft.model.attention import register_varlen

register_varlen()
family = sys.argv[1] if len(sys.argv) > 1 else "gemma4"
config = bench.config_for(family, 2, False)
rows = bench.rows
out = {}
for mode in ("varying", "same", "static"):
    bench.rows = (lambda total, seed, count: [rows(total, seed, 1)[0]] * count) if mode == "same" else rows
    torch._dynamo.config.automatic_dynamic_shapes = mode != "static"
    for variant in ("plain", "plain_compiled") if mode != "static" else ("plain_compiled",):
        run = bench.train(family, config, variant, "cuda", torch.bfloat16, 5, 4096, 989.0)
        out[f"{mode}/{variant}"] = {k: run[k] for k in ("losses", "grad_norms", "tokens_per_second")}
        print(mode, variant, out[f"{mode}/{variant}"], flush=True)
        torch._dynamo.reset()
with open(os.path.join(os.environ.get("OUT", "."), f"compile_rows_{family}.json"), "w") as f:
    json.dump(out, f, indent=1)
