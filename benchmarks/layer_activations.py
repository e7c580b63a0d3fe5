"""What one decoder layer of each family keeps for the backward, counted by autograd's saved-tensor hooks, against the
memory plan's count (`sft.plan.memory.activation_bytes_per_token`) for the same widths and kernels.

A model of 2 decoder layers and one of 1 (the same config otherwise) run forward in training mode on one row; the
bytes of the distinct storages autograd saves, other than the input embeddings and the weights, differ by one layer's.
Attention runs through PyTorch's sdpa (its flash kernel on a GPU, which saves what the varlen kernel saves: q, k, v,
the output and the log-sum-exp), whatever the family's own backend. On a GPU, the layer is also counted with Liger's
patches applied to the model instance as transformers' Trainer applies them (`use_liger_kernel`).

    python -m benchmarks.layer_activations --out $OUT/layer_activations       # on a GPU: transformers and Liger
    python -m benchmarks.layer_activations --tiny                              # on the CPU: tiny widths, no Liger
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sft.model import shapes
from sft.model.shapes import shipped_config
from sft.plan import memory as plan

# family -> a public config sft ships (their widths on the GPU)
FAMILY_MODELS = {"llama": "meta-llama/Llama-3.1-8B", "qwen2": "Qwen/Qwen2.5-7B", "qwen3": "Qwen/Qwen3-4B",
                 "mistral": "mistralai/Mistral-7B-v0.3", "gemma2": "google/gemma-2-9b",
                 "gemma3_text": "google/gemma-3-4b", "phi3": "microsoft/Phi-3-mini-4k-instruct",
                 "olmo2": "allenai/OLMo-2-1124-7B"}  # fmt: skip
TINY = {"hidden_size": 256, "intermediate_size": 640, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 512}  # fmt: skip


def _counting_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa over the whole row, causal, whatever the family asks for besides (a window, a cap: not what is counted)."""
    kept = {k: v for k, v in kwargs.items() if k in ("dropout", "scaling")}
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kept)


AttentionInterface.register("sft_counting", _counting_attention)


def config_of(family: str, tiny: bool, layers: int):
    fields = dict(shipped_config(FAMILY_MODELS[family]))
    fields.pop("model_type")
    fields.update(TINY if tiny else {"vocab_size": min(fields["vocab_size"], 32_768)})
    fields.update(num_hidden_layers=layers, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return AutoConfig.for_model(family, **fields)


def saved_per_token(config, tokens: int, device: str, liger: bool) -> float:
    """Bytes autograd saves per token for the decoder of `config` (input embeddings and weights not counted)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sft_counting", dtype=torch.bfloat16)
    model = model.to(device).train()
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    x = torch.randn(1, tokens, config.hidden_size, dtype=torch.bfloat16, device=device, requires_grad=True)
    positions = torch.arange(tokens, device=device)[None]
    return saved_bytes(lambda: model.model(inputs_embeds=x, position_ids=positions), x, *model.parameters()) / tokens


def saved_bytes(call, *apart: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `call()` runs, other than those of the
    tensors `apart` (the input, the weights)."""
    shared = {t.untyped_storage().data_ptr() for t in apart}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in shared:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return sum(saved.values())


def planned_per_layer(config, liger: bool) -> float:
    """The plan's activation bytes per token for one decoder layer of `config` (no checkpointing)."""
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        shape = shapes.load_shape(folder)
    setting = plan.Setting(liger=liger)
    two, one = (plan.activation_bytes_per_token(dataclasses.replace(shape, layers=n), setting) for n in (2, 1))
    return two - one


def count(family: str, tiny: bool, liger: bool, tokens: int, device: str) -> dict:
    one, two = (saved_per_token(config_of(family, tiny, n), tokens, device, liger) for n in (1, 2))
    planned = planned_per_layer(config_of(family, tiny, 2), liger)
    return {"family": family, "liger": liger, "tokens": tokens, "measured": two - one, "planned": planned,
            "ratio": (two - one) / planned}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="Tiny widths on the CPU (no Liger)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--families", nargs="*", default=list(FAMILY_MODELS))
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    rows = []
    for family in args.families:
        for liger in (False,) if args.tiny else (False, True):
            row = count(family, args.tiny, liger, 512 if args.tiny else args.tokens, device)
            rows.append(row)
            print(f"{family:12} liger={liger!s:5} measured {row['measured']:9.0f} B/token/layer, "
                  f"planned {row['planned']:9.0f}: {row['ratio']:.3f}", flush=True)  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        (args.out / "layer_activations.json").write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
