"""The model matrix on a GPU: attention exactness in bf16 and each fast path (Liger, FP8, compiled layers) per family.

    python -m benchmarks.architectures --out $OUT/architectures [--families llama gemma3 ...] [--compile] [--tiny]

For every family of the model matrix, at real widths (hidden >= 2048, `--layers` decoder layers, the vocabulary cut to
32,768 so that the decoder, not the LM head, is what is compared), with random weights:

1. **exactness**: four samples of 300-1500 tokens packed in one row (sliding windows set to 128 tokens, so every
   sample is longer than its window), through the backend sft's `auto` picks, against the same samples one at a
   time through transformers' `eager` attention: max per-token loss difference in bf16, beside bf16's own noise (each
   sample alone through sdpa against eager);
2. **fast paths**: a few optimizer steps (AdamW, packed rows of 4096 tokens, the same data for every variant) of
   `plain` (bf16, sft's attention, nothing else), `liger` (Liger's patches for the family, as transformers applies
   them), `fp8` (torchao float8 on the decoder linears, `sft.model.fp8.convert`) and `liger_fp8`; with `--compile` also
   each of those with compiled decoder layers. Per variant: grad norms finite, per-step loss against `plain`, tokens/s
   after the first steps, MFU on active parameters (`sft.model.architectures`), peak memory.

Parts 1 and 2 run in-process (no launcher, no DeepSpeed: their cost is the same for every family and measured
elsewhere); the kernels are the ones sft's trainer applies. With `--cli`, instead:

3. **sft's defaults** through the real entry point (`sft/train.py` under torchrun, 1 process, ZeRO-2, packing, rows
   of `--tokens`, `--layers` layers, pre-tokenised SFT-like data, `--steps` optimizer steps of 8 rows): exit code, the
   `Model:` and attention lines sft logged, per-step loss and grad norm (finite, falling), tokens/s and MFU. With
   `--trl`, each family's TRL baseline instead (`trl_setting`: the fastest setting a skilled TRL user runs for it on
   one GPU, through the same entry point), `trl` in its entry saying how it batched.

Writes `architectures.json` (`cli.json` with `--cli`) and `architectures.md` to `--out`.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import shutil
import time
import traceback
from pathlib import Path

import torch

VOCAB = 32768
WINDOW = 128
_GROUPED = {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1}
# Published widths of each family (the smallest >= 2048 wide), windows shortened to WINDOW
FAMILIES = {
    "llama": ("llama", {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "head_dim": 64}),
    "qwen2": ("qwen2", {"hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "head_dim": 128}),
    "qwen2-window": ("qwen2", {"hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
                               "num_key_value_heads": 2, "head_dim": 128, "use_sliding_window": True,
                               "sliding_window": WINDOW, "max_window_layers": 0}),
    "qwen3": ("qwen3", {"hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16,
                        "num_key_value_heads": 8, "head_dim": 128}),
    "qwen3_moe": ("qwen3_moe", {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                                "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 32,
                                "num_key_value_heads": 4, "head_dim": 128}),
    "mistral-window": ("mistral", {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                                   "num_key_value_heads": 8, "head_dim": 128, "sliding_window": WINDOW}),
    "mixtral": ("mixtral", {"hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
                            "num_experts_per_tok": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
                            "head_dim": 128}),
    "gemma2": ("gemma2", {"hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8,
                          "num_key_value_heads": 4, "head_dim": 256, "sliding_window": WINDOW,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3_text", {"hidden_size": 2560, "intermediate_size": 10240, "num_attention_heads": 8,
                               "num_key_value_heads": 4, "head_dim": 256, "sliding_window": WINDOW,
                               "sliding_window_pattern": 2, "query_pre_attn_scalar": 256}),
    "phi3": ("phi3", {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
                      "num_key_value_heads": 32, "sliding_window": WINDOW}),
    "olmo2": ("olmo2", {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
                        "num_key_value_heads": 16}),
    "glm4_moe": ("glm4_moe", {"hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                              "n_routed_experts": 64, "num_experts_per_tok": 8, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 128, **_GROUPED}),
    "gpt_oss": ("gpt_oss", {"hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 32,
                            "num_experts_per_tok": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
                            "head_dim": 64, "sliding_window": WINDOW}),
    "deepseek_v3": ("deepseek_v3", {"hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                                    "n_routed_experts": 64, "num_experts_per_tok": 6, "num_attention_heads": 16,
                                    "num_key_value_heads": 16, "q_lora_rank": 1536, "kv_lora_rank": 512,
                                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                                    "head_dim": 64, **_GROUPED}),
    # the newest families (transformers' default widths of each config; layer kinds alternated over --layers)
    "olmo3": ("olmo3", {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                        "num_key_value_heads": 32, "sliding_window": WINDOW,
                        "layer_types": ("sliding_attention", "full_attention")}),
    "smollm3": ("smollm3", {"hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
                            "num_key_value_heads": 4, "no_rope_layer_interval": 2}),
    "gemma4": ("gemma4_text", {"hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8,
                               "num_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
                               "sliding_window": WINDOW, "hidden_size_per_layer_input": 256,
                               "vocab_size_per_layer_input": VOCAB,
                               "layer_types": ("sliding_attention", "full_attention")}),
    "gemma4_moe": ("gemma4_text", {"hidden_size": 2816, "intermediate_size": 2112, "num_attention_heads": 16,
                                   "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
                                   "sliding_window": WINDOW, "enable_moe_block": True, "num_experts": 128,
                                   "top_k_experts": 8, "moe_intermediate_size": 704, "attention_k_eq_v": True,
                                   "num_global_key_value_heads": 2, "hidden_size_per_layer_input": 0,
                                   "layer_types": ("sliding_attention", "full_attention")}),
    "qwen3_5": ("qwen3_5_text", {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 16,
                                 "num_key_value_heads": 4, "head_dim": 256, "linear_num_value_heads": 32,
                                 "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                 "layer_types": ("linear_attention", "full_attention")}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
                                         "head_dim": 256, "num_experts": 256, "num_experts_per_tok": 8,
                                         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                                         "linear_num_value_heads": 32, "linear_num_key_heads": 16,
                                         "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                         "layer_types": ("linear_attention", "full_attention")}),
}  # fmt: skip
TINY = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
        "head_dim": 16, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16, "global_head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "top_k_experts": 2,
        "shared_expert_intermediate_size": 32, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "hidden_size_per_layer_input": 8}  # fmt: skip
SAMPLES = (300, 700, 1500, 1000)


def config_for(name: str, layers: int, tiny: bool):
    from transformers import AutoConfig

    model_type, widths = FAMILIES[name]
    widths = dict(widths)
    if tiny:
        same_heads = widths.get("num_key_value_heads") == widths["num_attention_heads"]
        widths.update({k: v for k, v in TINY.items() if k in widths})
        if model_type == "deepseek_v3":
            widths["head_dim"] = 8
        widths["num_key_value_heads"] = widths["num_attention_heads"] if same_heads else 2
        widths["num_global_key_value_heads"] = 1 if "num_global_key_value_heads" in widths else None
        widths = {k: v for k, v in widths.items() if v is not None}
    if isinstance(widths.get("layer_types"), tuple):  # a pattern, repeated over the layers
        pattern = widths["layer_types"]
        widths["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return AutoConfig.for_model(
        model_type, num_hidden_layers=layers, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=8192, **widths,
    )  # fmt: skip


def packed(lengths, device, seed: int) -> dict:
    """One packed row of random samples, as TRL's padding-free collator makes it."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    row = torch.cat(ids)[None]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = row.clone()
    labels[0, cu[:-1].long()] = -100  # a sample's first token is never trained from the previous sample
    batch = {"input_ids": row, "position_ids": positions, "labels": labels, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
             "max_length_q": max(lengths), "max_length_k": max(lengths)}  # fmt: skip
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def rows(total: int, seed: int, count: int) -> list[list[int]]:
    """`count` rows of SFT-like sample lengths filling `total` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths, left = [], total
        while left > 0:
            n = int(min(left, max(16, math.exp(math.log(300) + torch.randn(1, generator=gen).item()))))
            lengths.append(n)
            left -= n
        out.append(lengths)
    return out


def build(config, device, dtype):
    from transformers import AutoModelForCausalLM

    from sft.model import architectures, linear_attention

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    model.config.use_cache = False
    if architectures.of(config).attention.per_sample:  # Gated DeltaNet layers: sft's converter, as the trainer's
        linear_attention.by_sample(model)
    return model


def exactness(name: str, config, device, dtype) -> dict:
    """Packed through sft's `auto` backend vs eager one sample at a time: max per-token loss difference."""
    from sft.model import architectures
    from sft.model.attention import resolve_attn_implementation

    model = build(config, device, dtype).eval()
    arch = architectures.of(config)
    backend = resolve_attn_implementation("auto", False, arch, padding_free=True)
    lengths = SAMPLES if device != "cpu" else tuple(n // 20 for n in SAMPLES)
    batch = packed(lengths, device, seed=1)
    ids, cu = batch["input_ids"][0], batch["cu_seq_lens_q"].tolist()

    def losses(logits, lo, hi):
        return torch.nn.functional.cross_entropy(logits.float()[:-1], ids[lo + 1 : hi], reduction="none")

    with torch.no_grad():
        alone = [losses(model(input_ids=ids[None, lo:hi]).logits[0], lo, hi) for lo, hi in itertools.pairwise(cu)]
        model.set_attn_implementation(backend)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits[0]
        together = [losses(logits[lo:hi], lo, hi) for lo, hi in itertools.pairwise(cu)]
        # for scale: the same packed row through a backend that mixes the samples (a plain causal mask)
        model.set_attn_implementation(
            "sdpa" if arch.attention.softcap is None and not arch.attention.sinks else "eager"
        )
        mixed = model(input_ids=batch["input_ids"]).logits[0]
        leak = [losses(mixed[lo:hi], lo, hi) for lo, hi in itertools.pairwise(cu)]
        # the dtype's noise: each sample alone through sdpa against eager (None where sdpa cannot honour the model)
        noise = None
        if arch.attention.softcap is None and not arch.attention.sinks:
            sdpa = [losses(model(input_ids=ids[None, lo:hi]).logits[0], lo, hi) for lo, hi in itertools.pairwise(cu)]
            noise = max(float((a - b).abs().max()) for a, b in zip(alone, sdpa, strict=True))
    diffs = torch.cat([(a - b).abs() for a, b in zip(alone, together, strict=True)])
    diff = float(diffs.max())
    leak_diff = max(float((a - b).abs().max()) for a, b in zip(alone, leak, strict=True))
    del model
    return {"backend": backend, "needs": arch.attention.needs(), "max_token_loss_diff": diff,
            "median_token_loss_diff": float(diffs.median()), "tokens_over_0.1": int((diffs > 0.1).sum()),
            "mixed_samples_max_token_loss_diff": leak_diff, "alone_sdpa_vs_eager_max_token_loss_diff": noise,
            "samples": list(lengths)}  # fmt: skip


VARIANTS = {"plain": (False, False, False), "liger": (True, False, False), "fp8": (False, True, False),
            "liger_fp8": (True, True, False)}  # fmt: skip
COMPILED = {f"{k}_compiled": (liger, fp8, True) for k, (liger, fp8, _) in VARIANTS.items()}


def train(name: str, config, variant: str, device, dtype, steps: int, tokens: int, peak: float) -> dict:
    from sft.model import architectures, fp8
    from sft.model.attention import resolve_attn_implementation
    from sft.model.converters import compile_decoder_layers
    from sft.model.flops import FlopCounter

    liger, fp8_on, compiled = {**VARIANTS, **COMPILED}[variant]
    model = build(config, device, dtype)
    arch = architectures.of(config)
    model.set_attn_implementation(resolve_attn_implementation("auto", False, arch, padding_free=True))
    out = {"variant": variant}
    if liger:
        from transformers.integrations.liger import apply_liger_kernel

        if arch.family not in _liger_families():
            return {**out, "skipped": f"Liger has no patches for {arch.family}"}
        apply_liger_kernel(model, {})
    if fp8_on:
        try:
            out["fp8_layers"] = fp8.convert(model, "tensorwise")
        except Exception as e:  # noqa: BLE001  (no layer big enough: recorded)
            return {**out, "skipped": f"{type(e).__name__}: {e}"}
    if compiled:
        compile_decoder_layers(model)
    model.train()
    counter = FlopCounter(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device != "cpu")
    losses, norms, times, flops = [], [], [], []
    torch.cuda.reset_peak_memory_stats() if device != "cpu" else None
    for step, lengths in enumerate(rows(tokens, seed=2, count=steps)):
        batch = packed(lengths, device, seed=100 + step)
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        sync()
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        norms.append(float(norm))
        flops.append(float(counter.flops_of(torch.tensor(lengths))))
    timed = slice(2, None) if steps > 3 else slice(0, None)
    seconds = sum(times[timed])
    out.update(
        losses=losses, grad_norms=norms, finite=all(math.isfinite(x) for x in losses + norms),
        tokens_per_second=tokens * len(times[timed]) / seconds, step_seconds=times,
        mfu_active=sum(flops[timed]) / seconds / (peak * 1e12) if peak else None,
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None,
    )  # fmt: skip
    del model, optimizer
    return out


def _liger_families() -> set[str]:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)


def verdicts(runs: list[dict]) -> dict:
    """Each variant against `plain`: finite, the largest per-step relative loss difference, speed ratio."""
    plain = next((r for r in runs if r["variant"] == "plain" and "losses" in r), None)
    out = {}
    for r in runs:
        if "losses" not in r or plain is None:
            out[r["variant"]] = r.get("skipped") or r.get("error", "no plain run")
            continue
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], plain["losses"], strict=True))
        out[r["variant"]] = {"finite": r["finite"], "max_rel_loss_diff": rel,
                             "speed_vs_plain": r["tokens_per_second"] / plain["tokens_per_second"]}  # fmt: skip
    return out


CLI_RECIPE = {"bf16": True, "dtype": "bfloat16", "learning_rate": 1e-4, "lr_scheduler_type": "constant",
              "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "report_to": "none", "seed": 0,
              "from_scratch": True, "packing": True, "global_batch_size": 8, "report": False,
              "deepspeed": "ds_configs/zero2.json"}  # fmt: skip


# The fastest setting a skilled TRL user runs for a family on one GPU (issue #79's baseline), as recipe fields over
# CLI_RECIPE, run through sft's trainer as throughput.py's TRL rows are (TRL's SFTTrainer, plus sft's per-micro-batch
# check and FLOP count, which sft's rows pay too): no engine, bf16 weights stepped by torchao's own 8-bit AdamW
# (`optim: adamw_torch_8bit`; SFT_FUSED_ADAMW=0 keeps sft's fused step out), Liger where it has a patch for the family,
# no FP8 (TRL has none), no compiled layers, no checkpointing (`trl_setting` adds it where nothing fits without), the
# micro batch the largest that fits (sft's memory plan picks it, every lever pinned off).
TRL_FIELDS = {"deepspeed": "none", "optim": "adamw_torch_8bit", "fp8": False, "compile_decoder_layers": False,
              "activation_checkpointing": False, "tiled_mlp": False, "offload_checkpoints": False,
              "keep_attention_outputs": False}  # fmt: skip
TRL_ENV = {"SFT_FUSED_ADAMW": "0"}


def trl_setting(config) -> tuple[dict, str]:
    """The TRL baseline's fields for the family of `config`, and how it batches: packed rows on varlen
    FlashAttention-2 where TRL packs the family exactly (padding-free: every layer's heads within FlashAttention's
    256, no attention sinks, linear-attention layers only where fla trains unpatched), else padded rows grouped by
    length (`train_sampling_strategy: group_by_length`) on sdpa (eager for sinks, which sdpa cannot add)."""
    from sft.model import architectures, fla_hopper, linear_attention

    arch = architectures.of(config)
    attention = arch.attention
    fla_as_shipped = linear_attention.fla_cannot_train() is None and not fla_hopper.needed()
    packs = not attention.wide_heads and not attention.sinks and (not attention.per_sample or fla_as_shipped)
    fields = {**TRL_FIELDS, "use_liger_kernel": arch.family in _liger_families()}
    if packs:
        return {**fields, "packing": True, "attn_implementation": "sft_varlen"}, "packed, varlen FlashAttention-2"
    why = ("heads wider than 256" if attention.wide_heads else "attention sinks" if attention.sinks
           else "linear attention without fla able to train")  # fmt: skip
    kernel = "eager" if attention.sinks else "sdpa"
    padded = {"packing": False, "padding_free": False, "attn_implementation": kernel,
              "train_sampling_strategy": "group_by_length"}  # fmt: skip
    return {**fields, **padded}, f"padded rows grouped by length on {kernel} ({why})"


def samples_per_step(data: Path, tokens: int) -> int:
    """The power of two of samples of `data` (JSON lines of `input_ids`) nearest to `tokens` tokens."""
    lengths = [len(json.loads(line)["input_ids"]) for line in data.read_text().splitlines()]
    return 2 ** round(math.log2(tokens * len(lengths) / sum(lengths)))


def cli_runs(args, work: Path, results: dict) -> None:
    """Part 3: each family with sft's defaults through `sft/train.py` (see the module docstring), into
    `results["families"]`, written to `cli.json` after each family."""
    import yaml

    from benchmarks.common import make_sft_data, model_dir, run, sft_command

    data = work / "data.jsonl"
    make_sft_data(data, 400, VOCAB, args.tokens)
    out = results["families"]
    earlier = [str(work / name) for name in args.families if (work / name).exists()]
    if earlier:  # sft would refuse the run, and its metrics would be the earlier run's (call 29's Llama row)
        raise SystemExit(f"--work {work} holds earlier runs ({', '.join(earlier)}): pass a new --work")
    for name in args.families:
        config = config_for(name, args.layers, args.tiny).to_dict()
        config.update(pad_token_id=1, bos_token_id=2, eos_token_id=3)  # the demo tokenizer's
        model = model_dir(work / f"model-{name}", config)
        recipe = {**CLI_RECIPE, "model_name_or_path": str(model), "datasets": [{"path": str(data)}],
                  "output_dir": str(work / name), "max_steps": args.steps, "max_length": args.tokens}  # fmt: skip
        if args.tiny:
            recipe.update(bf16=False, dtype="float32", peak_tflops=1.0)
        if args.gpu_memory:
            recipe["max_gpu_memory_gib"] = args.gpu_memory
        if args.attn:
            recipe["attn_implementation"] = args.attn
        if args.engine_auto:
            del recipe["deepspeed"]
        env, batching = {}, None
        if args.trl:
            fields, batching = trl_setting(config_for(name, args.layers, args.tiny))
            recipe.pop("deepspeed", None)
            recipe.update(fields)
            env = TRL_ENV
            if not fields["packing"]:  # padded rows hold one sample each: as many tokens per optimizer step as packed
                recipe["global_batch_size"] = samples_per_step(data, recipe["global_batch_size"] * args.tokens)
        for field in args.set:  # each a one-line YAML mapping
            recipe.update(yaml.safe_load(field))
        (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        log = work / f"{name}.log"
        rc, seconds = run(sft_command(1, ["--config", str(work / f"{name}.yaml")]), log, env)
        if args.trl and rc != 0 and not (work / name / "metrics.jsonl").exists():  # nothing fits without checkpointing
            recipe["activation_checkpointing"] = True
            (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
            shutil.rmtree(work / name, ignore_errors=True)
            rc, seconds = run(sft_command(1, ["--config", str(work / f"{name}.yaml")]), log, env)
            batching += ", activation checkpointing (nothing fit without)"
        text = log.read_text()
        lines = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()] if (
            work / name / "metrics.jsonl").exists() else []  # fmt: skip
        steps = [r for r in lines if "loss" in r and "grad_norm" in r]
        said = [x.split(": ", 1)[1] for x in text.splitlines() if "sft.model.architectures: Model:" in x
                or "Attention backend:" in x or "auto settings:" in x]  # fmt: skip
        chosen = [x.strip() for x in text.splitlines() if x.strip().startswith("chosen micro batch")]
        entry = out[name] = {
            **({"trl": batching} if args.trl else {}),
            "exit_code": rc,
            "seconds": round(seconds, 1),
            "said": said,
            "plan": chosen[-1] if chosen else None,  # the setting the plan chose, its estimates (speed model, peak)
            "losses": [r["loss"] for r in steps],
            "grad_norms": [r["grad_norm"] for r in steps],
        }
        if steps:
            timed = steps[3:] or steps
            entry.update(
                finite=all(math.isfinite(x) for x in entry["losses"] + entry["grad_norms"]),
                loss_fell=entry["losses"][-1] < entry["losses"][0],
                tokens_per_second=sum(r["tokens_per_second_per_gpu"] for r in timed) / len(timed),
                mfu=sum(r.get("mfu", 0.0) for r in timed) / len(timed),
                peak_memory_gib=max(r.get("peak_memory_gib", 0.0) for r in steps),
            )  # fmt: skip
        if rc != 0 or not steps:
            entry["log_tail"] = text[-3000:]
        print(name, {k: v for k, v in entry.items() if k != "log_tail"}, flush=True)
        (args.out / "cli.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/architectures"))
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per packed row (one row per step)")
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny widths, fp32, plain variant only")
    parser.add_argument("--cli", action="store_true", help="part 3 only: sft's defaults through sft/train.py")
    parser.add_argument("--engine-auto", action="store_true", help="with --cli: no DeepSpeed config, the engine and "
                        "optimizer sft's plan picks (one GPU: no engine, 8-bit AdamW)")  # fmt: skip
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD: VALUE",
        help="with --cli: recipe fields over the defaults, YAML ('compile_decoder_layers: true')",
    )
    parser.add_argument("--trl", action="store_true", help="with --cli: the fastest setting a skilled TRL user runs "
                        "for each family instead of sft's defaults (`trl_setting`)")  # fmt: skip
    parser.add_argument("--work", type=Path, help="with --cli: the folder for the models, recipes and run logs "
                        "(default: a new temporary one)")  # fmt: skip
    parser.add_argument("--attn", help="with --cli: attn_implementation instead of sft's auto (e.g. sdpa)")
    parser.add_argument("--gpu-memory", type=float, help="with --cli: GiB each run is planned for and capped at "
                        "(max_gpu_memory_gib; 79.18 for an 80 GB card)")  # fmt: skip
    args = parser.parse_args()
    from benchmarks.common import environment
    from sft.model.attention import register_varlen
    from sft.model.flops import detect_peak_tflops

    register_varlen()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    peak = detect_peak_tflops(torch.cuda.get_device_name()) if device == "cuda" else None
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cli:
        import tempfile

        cli = {"environment": environment(), "layers": args.layers, "tokens_per_row": args.tokens, "steps": args.steps,
               "families": {}}  # fmt: skip
        work = args.work or Path(tempfile.mkdtemp(prefix="architectures-cli-"))
        work.mkdir(parents=True, exist_ok=True)
        cli_runs(args, work, cli)
        return
    results = {"environment": environment(), "layers": args.layers, "tokens_per_row": args.tokens,
               "vocab": VOCAB, "window": WINDOW, "peak_tflops": peak, "families": {}}  # fmt: skip
    for name in args.families:
        config = config_for(name, args.layers, args.tiny)
        entry = results["families"][name] = {
            "config": {
                k: v for k, v in config.to_dict().items() if isinstance(v, int | float | str | list | type(None))
            }
        }
        if not args.skip_exactness:
            try:
                entry["exactness"] = exactness(name, config, device, dtype)
            except Exception as e:  # noqa: BLE001  (one family's failure is a result, not the end of the matrix)
                entry["exactness"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(name, "exactness", {k: v for k, v in entry["exactness"].items() if k != "trace"}, flush=True)
        runs = []
        for variant in args.variants if not args.tiny else ["plain"]:
            try:
                run = train(name, config, variant, device, dtype, args.steps, args.tokens, peak)
            except Exception as e:  # noqa: BLE001
                run = {"variant": variant, "error": f"{type(e).__name__}: {str(e)[:500]}",
                       "trace": traceback.format_exc()[-2000:]}  # fmt: skip
            runs.append(run)
            print(name, variant, {k: v for k, v in run.items() if k not in ("trace", "step_seconds")}, flush=True)
            gc.collect()
            torch.cuda.empty_cache() if device == "cuda" else None
            torch._dynamo.reset()
        entry["runs"] = runs
        entry["verdicts"] = verdicts(runs)
        (args.out / "architectures.json").write_text(json.dumps(results, indent=1))
    (args.out / "architectures.md").write_text(table(results))
    print(table(results))


def table(results: dict) -> str:
    lines = [f"GPU: {results['environment'].get('gpu', '?')}; {results['layers']} layers, rows of "
             f"{results['tokens_per_row']} tokens, vocab {results['vocab']}, windows {results['window']}", "",
             "| family | backend | packed vs eager (max token loss diff) | alone: sdpa vs eager (bf16's noise) | "
             "mixed-sample diff | variant | finite | max rel loss diff vs plain | speed vs plain | tokens/s | "
             "MFU (active) | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, entry in results["families"].items():
        ex = entry.get("exactness", {})
        for run in entry.get("runs", []):
            v = entry["verdicts"].get(run["variant"])
            if isinstance(v, dict):
                cells = [str(v["finite"]), f"{v['max_rel_loss_diff']:.2e}", f"{v['speed_vs_plain']:.3f}",
                         f"{run['tokens_per_second']:,.0f}",
                         f"{run['mfu_active']:.3f}" if run.get("mfu_active") else "-",
                         f"{run['peak_memory_gib']:.1f}" if run.get("peak_memory_gib") else "-"]  # fmt: skip
            else:
                cells = [str(v)[:80], "-", "-", "-", "-", "-"]
            lines.append(f"| {name} | {ex.get('backend', ex.get('error', '-'))[:40]} | "
                         f"{ex.get('max_token_loss_diff', float('nan')):.4f} | "
                         f"{ex.get('alone_sdpa_vs_eager_max_token_loss_diff') or float('nan'):.4f} | "
                         f"{ex.get('mixed_samples_max_token_loss_diff', float('nan')):.4f} | {run['variant']} | "
                         + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
