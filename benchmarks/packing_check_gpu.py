"""The packing check (`sft.run.packing_check.compare`) on a GPU in bf16: its 16-bit tolerance against each family.

    python -m benchmarks.packing_check_gpu --out DIR [--families llama gemma4 ...]

For each family of `benchmarks.architectures` (its widths, 2 layers, random weights, bf16): one packed row of four
samples (300-1,500 tokens) through the backend sft's `auto` picks, against each sample alone, as the check runs at the
start of a run: the mean relative difference of the last hidden states per sample, against the tolerance (2e-2), and
how far the later samples move when the first sample's tokens change (its influence: none where packing is exact).
Then the same row through attention blind to the boundaries (sdpa, causal over the whole row, the masks dropped): the
check must refuse it. Writes `packing_check_gpu.json` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "mistral-window", "gemma2", "gemma3", "gpt_oss", "olmo3", "smollm3", "gemma4",
            "gemma4_moe", "qwen3_5", "qwen3_5_moe")  # fmt: skip


def blind(module, query, key, value, attention_mask, **kwargs):
    """sdpa over the whole row, causal, whatever the row's boundaries: what packing without them computes."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs = {k: v for k, v in kwargs.items() if k in ("dropout", "scaling")}
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    from transformers import AttentionInterface

    from benchmarks.architectures import SAMPLES, build, config_for, packed
    from sft.model import architectures
    from sft.model.attention import register_varlen, resolve_attn_implementation
    from sft.run.packing_check import compare

    register_varlen()
    AttentionInterface.register("blind", blind)
    gpu = torch.cuda.is_available()  # on a CPU: tiny widths, fp32, short samples (a smoke run of this script)
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    lengths = SAMPLES if gpu else tuple(n // 20 for n in SAMPLES)
    results = {"gpu": torch.cuda.get_device_name() if gpu else "cpu", "date": time.strftime("%Y-%m-%d")}
    results["families"] = {}
    for name in args.families:
        model = None
        try:
            config = config_for(name, 2, tiny=not gpu)
            model = build(config, device, dtype)
            backend = resolve_attn_implementation("auto", False, architectures.of(config), padding_free=True)
            batch = packed(lengths, device, seed=1)
            batch = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
            model.set_attn_implementation(backend)
            exact = compare(model, batch)
            model.set_attn_implementation("blind")
            leaky = compare(model, batch)
            entry = {"backend": backend, "differences": exact.differences, "influence": exact.influence,
                     "passes": not exact.leaks, "blind_differences": leaky.differences,
                     "blind_influence": leaky.influence, "blind_refused": leaky.leaks, "tolerance": exact.tolerance,
                     "influence_tolerance": exact.influence_tolerance, "seconds": exact.seconds}  # fmt: skip
        except Exception as e:  # noqa: BLE001  (one family's failure is a result)
            entry = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        results["families"][name] = entry
        print(name, entry, flush=True)
        del model
        torch.cuda.empty_cache() if gpu else None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packing_check_gpu.json").write_text(json.dumps(results, indent=1))
    tolerance = next((e["tolerance"] for e in results["families"].values() if "tolerance" in e), float("nan"))
    print(f"| family | backend | worst packed (tolerance {tolerance:.0e}) | worst influence | passes | best blind | "
          "least blind influence | refused |")  # fmt: skip
    for name, e in results["families"].items():
        if "error" in e:
            print(f"| {name} | {e['error'][:80]} | | | | | | |")
            continue
        exact = f"{max(e['differences']):.1e} | {max(e['influence']):.1e} | {e['passes']}"
        leaky = f"{min(e['blind_differences'][1:]):.1e} | {min(e['blind_influence']):.1e} | {e['blind_refused']}"
        print(f"| {name} | {e['backend']} | {exact} | {leaky} |")


if __name__ == "__main__":
    main()
