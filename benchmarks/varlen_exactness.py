"""sft_varlen (PyTorch's varlen FlashAttention-2) on a packed row versus sdpa on each sample alone, on a CUDA GPU.

    python -m benchmarks.varlen_exactness --out benchmarks/results

For Llama- and Qwen2-shaped random models with grouped-query attention, in bf16: the packed row's logits and the
gradients of the summed token loss, against the same samples run one at a time through sdpa. Both are also compared
with an fp32 per-sample sdpa run, so the bf16 differences are read against bf16's own error. Unpacked batches
(right-padded rows with an attention mask, and full rows) are compared with sdpa on the same batch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from sft.model.attention import VARLEN, register_varlen

SHAPES = {
    "llama": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128},
    "qwen2": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
              "num_key_value_heads": 2, "head_dim": 128, "use_sliding_window": False},
}  # fmt: skip
LENGTHS = [37, 512, 1000, 3, 129, 2048]


def run(model, batch, impl: str, per_sample: bool):
    model.set_attn_implementation(impl)
    model.zero_grad()
    bounds = batch["cu_seq_lens_q"].tolist()
    if per_sample:
        logits = torch.cat(
            [model(input_ids=batch["input_ids"][:, lo:hi]).logits[0] for lo, hi in itertools.pairwise(bounds)]
        )
    else:
        inputs = {k: v for k, v in batch.items() if k != "labels" and k != "seq_idx"}
        logits = model(**inputs).logits[0]
    labels = batch["labels"][0].roll(-1)
    loss = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return logits.float().detach(), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    register_varlen()
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(10, 32000, (n,)).tolist(), "seq_lengths": [n]} for n in LENGTHS]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "lengths": LENGTHS}
    results["date"] = time.strftime("%Y-%m-%d")
    for name, shape in SHAPES.items():
        config = AutoConfig.for_model(**shape, vocab_size=32000, num_hidden_layers=args.layers)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda()
        ref_logits, ref_grads = run(model, batch, "sdpa", per_sample=True)  # fp32 reference
        model = model.to(torch.bfloat16)
        sdpa_logits, sdpa_grads = run(model, batch, "sdpa", per_sample=True)
        var_logits, var_grads = run(model, batch, VARLEN, per_sample=False)

        def rel(a, b):
            return ((a - b).norm() / b.norm()).item()

        results[name] = {
            "max_abs_logit_diff_varlen_vs_sdpa_bf16": (var_logits - sdpa_logits).abs().max().item(),
            "max_abs_logit_diff_sdpa_bf16_vs_fp32": (sdpa_logits - ref_logits).abs().max().item(),
            "max_abs_logit_diff_varlen_bf16_vs_fp32": (var_logits - ref_logits).abs().max().item(),
            "rel_grad_diff_varlen_vs_sdpa_bf16": rel(var_grads, sdpa_grads),
            "rel_grad_diff_sdpa_bf16_vs_fp32": rel(sdpa_grads, ref_grads),
            "rel_grad_diff_varlen_bf16_vs_fp32": rel(var_grads, ref_grads),
        }
        # unpacked batches: right-padded rows with a 2D attention_mask, and full rows without one
        model.set_attn_implementation("sdpa")
        ids = torch.randint(10, 32000, (3, 256), device="cuda")
        mask = torch.ones_like(ids)
        mask[1, 200:] = 0
        mask[2, 31:] = 0
        with torch.no_grad():
            for label, kwargs in (("padded", {"attention_mask": mask}), ("full_rows", {})):
                model.set_attn_implementation("sdpa")
                ref = model(input_ids=ids, **kwargs).logits.float()
                model.set_attn_implementation(VARLEN)
                out = model(input_ids=ids, **kwargs).logits.float()
                keep = mask.bool() if kwargs else torch.ones_like(mask, dtype=torch.bool)
                results[name][f"max_abs_logit_diff_unpacked_{label}_varlen_vs_sdpa_bf16"] = (
                    (out - ref)[keep].abs().max().item()
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "varlen_exactness.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
