"""What a Gated DeltaNet layer keeps for the backward on each of sft's paths over a packed row, counted by autograd's
saved-tensor hooks, against the memory plan's count (`sft.plan.memory.linear_attention_bytes_per_token`, fitted on
transformers' torch recurrence): the numbers the plan needs for fla's kernels and for the recurrence batched over
groups of samples (issue #79, item 7; on one H100 the plan said 53.03 GiB for Qwen3.5 at 8 layers where fla's run
peaked at 36.0 and the batched one at 62.8: benchmarks/results/families_2026, item 23).

A Qwen3.5 text model (its widths, or the tests' with `--tiny`; bf16) of 2 linear-attention layers and one of 4
(and one full-attention layer each), the same otherwise, run forward in training mode on one packed row of SFT-like
samples through `sft.model.linear_attention`'s path (`varlen`: fla's kernels, which need a GPU with fla installed;
`batched`; `per-sample`); the bytes of the distinct storages autograd saves, other than the input and the weights,
differ by two layers'. Those layers' MLPs and norms are counted by the plan as for any family (checked elsewhere),
so the difference to the plan is the token mixer's. The peak of the layer's backward (its transients) is not
counted here.

    python -m benchmarks.linear_activations --out $OUT/linear_activations            # on a GPU: the three paths
    python -m benchmarks.linear_activations --tiny --paths batched per-sample        # on the CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.architectures import config_for, rows
from benchmarks.layer_activations import saved_bytes


def _config(linear: int, tiny: bool):
    """`linear` Gated DeltaNet layers and one full-attention layer (the plan's shape wants one)."""
    config = config_for("qwen3_5", linear + 1, tiny)
    config.layer_types = ["linear_attention"] * linear + ["full_attention"]
    config.use_cache = False
    return config


def saved_per_token(layers: int, tiny: bool, path: str, lengths: list[int], device: str) -> float:
    """Bytes autograd saves per token for the decoder of `layers` linear-attention layers on `path`."""
    from transformers import AutoModelForCausalLM

    from sft.model import linear_attention

    torch.manual_seed(0)
    dtype = torch.bfloat16  # what the plan's term was fitted in (on the CPU too)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            _config(layers, tiny), attn_implementation="sft_counting", dtype=dtype
        )
    model.train()
    linear_attention.by_sample(model, varlen=path == "varlen", batched=path == "batched")
    tokens = sum(lengths)
    x = torch.randn(1, tokens, model.config.hidden_size, dtype=dtype, device=device, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    kwargs = {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
              "max_length_k": max(lengths)}  # fmt: skip
    return saved_bytes(lambda: model.model(inputs_embeds=x, **kwargs), x, *model.parameters()) / tokens


def planned_per_layer(tiny: bool) -> float:
    """The plan's activation bytes per token for one linear-attention layer (no checkpointing, bf16)."""
    four, two = (_planned(n, tiny) for n in (4, 2))
    return (four - two) / 2


def _planned(linear: int, tiny: bool) -> float:
    from sft.model import shapes
    from sft.plan import memory as plan

    with tempfile.TemporaryDirectory() as folder:
        _config(linear, tiny).save_pretrained(folder)
        return plan.activation_bytes_per_token(shapes.load_shape(folder), plan.Setting())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="the tests' widths, on the CPU")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--paths", nargs="*", default=["varlen", "batched", "per-sample"])
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    lengths = rows(512 if args.tiny else args.tokens, seed=2, count=1)[0]
    planned = planned_per_layer(args.tiny)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tiny": args.tiny,
           "samples": lengths, "planned_per_layer": planned, "paths": {}}  # fmt: skip
    for path in args.paths:
        try:
            four, two = (saved_per_token(n, args.tiny, path, lengths, device) for n in (4, 2))
        except Exception as e:  # noqa: BLE001  (a path that cannot run here, e.g. fla without a GPU, is a result)
            out["paths"][path] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(path, out["paths"][path], flush=True)
            continue
        measured = (four - two) / 2
        out["paths"][path] = {"measured_per_layer": measured, "of_planned": measured / planned}
        print(f"{path:10} measured {measured:9.0f} B/token/layer, planned {planned:9.0f}: {measured / planned:.3f}",
              flush=True)  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "linear_activations.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
