"""Qwen3.5's Gated DeltaNet layers over packed rows on a GPU: flash-linear-attention's varlen kernels against the
per-sample torch path (`sft.model.linear_attention`).

    python -m benchmarks.linear_attention --path varlen|batched|per-sample --out DIR   # one path, this process's
    python -m benchmarks.linear_attention --compare DIR                                 # the table of every run in DIR
    python -m benchmarks.linear_attention --path batched --device cpu --tiny --tokens 2048 --out DIR   # on the CPU

A Qwen3.5 text model at its default widths (hidden 4096, 16 query / 4 key-value heads of 256 on the full layers, 32
value / 16 key heads of 128 on the linear ones), `--layers` layers alternating linear and full attention, the
vocabulary cut to 32,768, random weights, bf16 (`--tiny`: the architecture tests' widths, fp32, for a CPU):

1. **exactness**: four samples of 300-1500 tokens packed in one row, through the path, against each sample alone
   through transformers' own forward (eager attention on the full layers): per-token losses, written to the run's
   JSON so that `--compare` can set every path against the pure torch reference (a run without fla installed);
2. **speed**: rows of `--tokens` SFT-like sample lengths, `--steps` timed after one warm-up, forward alone and forward
   with backward: tokens/s and peak memory (an error, such as fla refusing its backward, is recorded as the result).

Which linear-attention kernels transformers uses is decided when it is imported: fla's `chunk_gated_delta_rule` where
the `fla` package is importable, its torch reference otherwise (sft gives the layers the torch functions back where
fla is installed but not used). The call script runs `per-sample` without fla and `varlen` with it, one process each.
`batched` and `per-sample` are both the torch path: its recurrence once per group of similar-length samples, or once
per sample.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

SAMPLES = (300, 700, 1500, 1000)


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _model(layers: int, tiny: bool = False, dtype: torch.dtype | None = None):
    """The model without sft's converter (`benchmarks.architectures.build` applies it with its default path), in
    `dtype` (default: fp32 at the tiny widths, else bf16)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.architectures import config_for

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(
            config_for("qwen3_5", layers, tiny=tiny), attn_implementation="eager",
            dtype=dtype or (torch.float32 if tiny else torch.bfloat16),
        )  # fmt: skip
    model.config.use_cache = False
    return model.eval()


def exactness(model, convert) -> dict:
    from benchmarks.architectures import packed
    from sft.model.attention import VARLEN

    batch = packed(SAMPLES, DEVICE, seed=1)
    ids, cu = batch["input_ids"][0], batch["cu_seq_lens_q"].tolist()

    def losses(logits, lo, hi):
        return torch.nn.functional.cross_entropy(logits.float()[:-1], ids[lo + 1 : hi], reduction="none")

    with torch.no_grad():
        alone = [losses(model(input_ids=ids[None, lo:hi]).logits[0], lo, hi) for lo, hi in itertools.pairwise(cu)]
        convert(model)
        model.set_attn_implementation(VARLEN)
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        together = [losses(logits[lo:hi], lo, hi) for lo, hi in itertools.pairwise(cu)]
    diffs = torch.cat([(a - b).abs() for a, b in zip(alone, together, strict=True)])
    return {"alone": torch.cat(alone).tolist(), "packed": torch.cat(together).tolist(),
            "max_token_loss_diff": float(diffs.max()), "median_token_loss_diff": float(diffs.median())}  # fmt: skip


def gradients(layers: int, tiny: bool, convert) -> dict:
    """Every parameter's gradient of a packed row's loss through the path (`convert`, in the benchmark's dtype) and
    through the per-sample torch path in the same dtype (bf16's own noise), each against the per-sample torch path in
    fp32 (exact against each sample alone: tests/test_linear_attention.py): the largest relative difference
    |g - g_fp32| / |g_fp32| over the parameters, over the linear-attention layers' ones, and their median."""
    from benchmarks.architectures import packed
    from sft.model import linear_attention

    batch = packed(SAMPLES, DEVICE, seed=1)
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def grads(model) -> dict:
        logits = model(**inputs).logits[0].float()
        torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], ignore_index=-100).backward()
        out = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    def model_of(dtype, path_convert):
        from sft.model.attention import VARLEN

        m = _model(layers, tiny, dtype)
        path_convert(m)
        m.set_attn_implementation(VARLEN)
        return m

    def per_sample(m):
        return linear_attention.by_sample(m, varlen=False)

    reference = grads(model_of(torch.float32, per_sample))
    dtype = torch.float32 if tiny else torch.bfloat16
    result = {}
    for name, fn in (("path", convert), ("torch_same_dtype", per_sample)):
        g = grads(model_of(dtype, fn))
        rel = {n: float((g[n] - r).norm() / r.norm().clamp_min(1e-30)) for n, r in reference.items()}
        linear = [v for n, v in rel.items() if "linear_attn" in n]
        result[name] = {"max_rel": max(rel.values()), "median_rel": float(torch.tensor(list(rel.values())).median()),
                        "linear_attn_max_rel": max(linear), "worst": max(rel, key=rel.get)}  # fmt: skip
        del g
    return result


def speed(model, tokens: int, steps: int) -> dict:
    """Forward alone (no gradients) and forward with backward over the same rows; an error is a result."""
    from benchmarks.architectures import packed, rows

    batches = [packed(lengths, DEVICE, seed=i) for i, lengths in enumerate(rows(tokens, 7, steps + 1))]
    out = {"samples_per_row": [len(r) for r in rows(tokens, 7, steps + 1)]}
    for mode in ("forward", "train"):
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        try:
            for i, batch in enumerate(batches):
                _sync()
                start = time.perf_counter()
                with torch.set_grad_enabled(mode == "train"):
                    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
                    if mode == "train":
                        labels = batch["labels"][0, 1:]
                        torch.nn.functional.cross_entropy(logits.float()[:-1], labels, ignore_index=-100).backward()
                        model.zero_grad(set_to_none=True)
                _sync()
                if i:  # the first row warms the kernels up (Triton's autotuning)
                    seconds.append(time.perf_counter() - start)
        except RuntimeError as e:
            out[mode] = {"error": str(e)[:400]}
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None
        out[mode] = {"tokens_per_second": tokens * len(seconds) / sum(seconds), "step_seconds": seconds,
                     "peak_memory_gib": peak}  # fmt: skip
    return out


def compare(folder: Path) -> str:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("linear_attention_*.json"))}
    torch_runs = [r for r in runs.values() if not r["fla_installed"]]
    reference = torch.tensor(torch_runs[0]["exactness"]["alone"]) if torch_runs else None
    lines = ["| run | path | packed vs alone, same kernels (max / median token loss diff) | packed vs torch alone "
             "(max) | gradients vs fp32 torch (max rel: path / bf16 torch) | forward tokens/s | forward+backward "
             "tokens/s | peak GiB (train) | Triton |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip

    def grads(r: dict) -> str:
        g = r.get("gradients")
        if not g:
            return "-"
        if "error" in g:
            return g["error"][:80]
        return f"{g['path']['max_rel']:.4f} / {g['torch_same_dtype']['max_rel']:.4f}"

    def cell(mode: dict) -> str:
        return f"{mode['tokens_per_second']:,.0f}" if "tokens_per_second" in mode else mode["error"][:120]

    for name, r in runs.items():
        ex, sp = r["exactness"], r["speed"]
        against = float((torch.tensor(ex["packed"]) - reference).abs().max()) if reference is not None else None
        lines.append(f"| {name} | {r['path']} | {ex['max_token_loss_diff']:.4f} / {ex['median_token_loss_diff']:.4f} "
                     f"| {against if against is None else f'{against:.4f}'} | {grads(r)} | {cell(sp['forward'])} | "
                     f"{cell(sp['train'])} | {sp['train'].get('peak_memory_gib') or float('nan'):.1f} | "
                     f"{r.get('triton', '?')} |")  # fmt: skip
    first = next(iter(runs.values()), {})
    return (
        f"GPU: {first.get('gpu', '?')}; Qwen3.5 text widths, {first.get('layers')} layers, rows of "
        f"{first.get('tokens_per_row')} tokens, {'fp32, tiny widths' if first.get('tiny') else 'bf16'}\n\n"
        + "\n".join(lines)
        + "\n"
    )


def _triton() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=("varlen", "batched", "per-sample"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the architecture tests' widths, fp32")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--grads", action="store_true", help="also every gradient against the fp32 torch path's")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        (args.out / "linear_attention.md").write_text(text := compare(args.out))
        print(text)
        return
    from sft.model import linear_attention
    from sft.model.attention import register_varlen

    global DEVICE
    DEVICE = args.device
    register_varlen()
    model = _model(args.layers, args.tiny)

    def convert(m):
        return linear_attention.by_sample(m, varlen=args.path == "varlen", batched=args.path == "batched")

    card = torch.cuda.get_device_name() if DEVICE == "cuda" else f"CPU ({os.cpu_count()} cores)"
    result = {"path": args.path, "fla_installed": linear_attention.FLA, "gpu": card, "tiny": args.tiny,
              "layers": args.layers, "tokens_per_row": args.tokens, "triton": _triton()}  # fmt: skip
    result["exactness"] = exactness(model, convert)
    if args.grads:
        try:
            result["gradients"] = gradients(args.layers, args.tiny, convert)
        except RuntimeError as e:  # fla refusing its backward is a result
            result["gradients"] = {"error": str(e)[:400]}
        print("gradients", result["gradients"], flush=True)
    result["speed"] = speed(model, args.tokens, args.steps)
    if args.path == "varlen":
        from sft.model import fla_hopper

        result["sft_dqkwg"] = fla_hopper.registered()  # fla's refused backward piece through sft's torch form
    name = f"linear_attention_{args.path}{'_fla' if linear_attention.FLA else '_torch'}"
    (args.out / f"{name}.json").write_text(json.dumps(result))
    print(name, {k: v for k, v in result["exactness"].items() if "diff" in k}, result["speed"], flush=True)


if __name__ == "__main__":
    main()
