"""Packed attention on the CPU, a training step of the demo's model (what `auto` picks there, and what the suite's
and the demo's CPU runs cost): sdpa over the block mask transformers builds from the packed position ids, sft_varlen
one sdpa call per sample (sft's CPU path before 2026-12-07), and sft_varlen over the samples padded to a batch per
length bucket (`sft.model.attention.per_sample_sdpa`, now).

    python -m benchmarks.cpu_attention --out benchmarks/results/cpu_attention.json

Two rows of 512 tokens packed from samples of the demo's lengths (15 to 29 tokens), fp32, forward and backward with
the loss; milliseconds per step (median of 15 after 3), at 1 and 2 threads. Each path's logits against eager one
sample at a time (max abs difference).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from sft.model.attention import VARLEN, register_varlen, varlen_attention_forward

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "demo" / "model"
ONE_CALL_PER_SAMPLE = "one_call_per_sample"


def one_call_per_sample(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), **_):
    """sft's CPU path before: causal sdpa once per sample."""
    outs = []
    for qs, ks, vs in zip(*(t.split(cu_q.diff().tolist()) for t in (q, k, v)), strict=True):
        qs, ks, vs = (t.transpose(0, 1) for t in (qs, ks, vs))
        attended = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[0] != qs.shape[0]
        )
        outs.append(attended.transpose(0, 1))
    return torch.cat(outs)


def register_old() -> None:
    import sft.model.attention as attention

    def forward(*args, **kwargs):
        kernel = attention.per_sample_sdpa
        attention.per_sample_sdpa = one_call_per_sample
        try:
            return varlen_attention_forward(*args, **kwargs)
        finally:
            attention.per_sample_sdpa = kernel

    AttentionInterface.register(ONE_CALL_PER_SAMPLE, forward)


def rows(seed: int = 0, length: int = 512, count: int = 2) -> list[list[int]]:
    rng, out = random.Random(seed), []
    for _ in range(count):
        lengths = []
        while sum(lengths) < length - 29:
            lengths.append(rng.randint(15, 29))
        out.append([*lengths, length - sum(lengths)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    register_varlen()
    register_old()
    config = AutoConfig.from_pretrained(DEMO)
    lengths = [n for row in rows() for n in row]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, positions.shape[1]))
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    weights = reference.state_dict()
    with torch.no_grad():
        alone = torch.cat([reference(input_ids=s[None], use_cache=False).logits[0] for s in ids[0].split(lengths)])
    results = {"cpu": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "rows": []}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for backend in ("sdpa", ONE_CALL_PER_SAMPLE, VARLEN):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=backend)
            model.load_state_dict(weights)

            def step(model=model):
                out = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
                out.loss.backward()
                return out

            for _ in range(3):
                out = step()
            times = []
            for _ in range(15):
                started = time.perf_counter()
                step()
                times.append((time.perf_counter() - started) * 1e3)
            row = {"backend": backend, "threads": threads, "ms_per_step": statistics.median(times),
                   "max_abs_vs_eager_alone": float((out.logits[0].detach() - alone).abs().max())}  # fmt: skip
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    for threads in (1, 2):
        by = {r["backend"]: r["ms_per_step"] for r in results["rows"] if r["threads"] == threads}
        results[f"speedup_vs_sdpa_{threads}_threads"] = by["sdpa"] / by[VARLEN]
        results[f"speedup_vs_one_call_per_sample_{threads}_threads"] = by[ONE_CALL_PER_SAMPLE] / by[VARLEN]
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k.startswith("speedup")}))


if __name__ == "__main__":
    main()
