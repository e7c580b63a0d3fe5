"""benchmarks/results/families_2026/summary.json from that folder's runs (issue #79): one row per family and path.

    python -m benchmarks.families_2026 [--folder benchmarks/results/families_2026]

Each row: a family's `sft/train.py` run (`benchmarks/architectures.py --cli`: its public widths at `layers` decoder
layers, rows of 4,096, planned for and capped at 79.18 GiB; `engine`: ZeRO-2 on one process (`ds_configs/zero2.json`)
or what sft's plan picks on one GPU (`--engine-auto`: no engine, 8-bit AdamW)) beside the Llama run of the same device
call (the same depth and engine; `llama.file` names it: one row's Llama is from the call before, said in RUNS), and
their MFU ratio. `trl` (the fastest TRL setting for the family) stays null until measured; `estimate` is the plan's
(speed model and memory plan) for runs that kept its log line, null for the older ones. `steps`: the one-GPU
optimizer step's rows (`benchmarks/optimizer_step.py`, item 5 of the issue), each set's fused 8-bit step with
stochastic rounding and torch's fused fp32 AdamW against the bytes they move over the card's bandwidth (H200 4.8
TB/s, H100 3.35 TB/s); the latest file per card and set (STEPS).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# (file, family in it, the path it ran, the same call's Llama file, the call, the engine)
ZERO2, PLANNED = "ZeRO-2 (ds_configs/zero2.json)", "sft's one-GPU plan (no engine, 8-bit AdamW)"
RUNS = (
    ("cli_call2_fla.json", "qwen3_5", "fla varlen kernels, Triton 3.7.1", "cli_call2_torch.json", 2, ZERO2),
    ("cli_call2_torch.json", "qwen3_5", "torch recurrence, batched, Triton 3.6", "cli_call2_torch.json", 2, ZERO2),
    ("cli_call4_gemma4_auto.json", "gemma4", "sft_varlen per layer, 512-wide heads per sample", "cli_call4_llama.json",
     4, ZERO2),
    ("cli_call4_gemma4_sdpa.json", "gemma4", "sdpa with the packed mask (before)", "cli_call4_llama.json", 4, ZERO2),
    ("cli_call5_dense.json", "gemma4", "sft_varlen per layer, 512-wide heads per sample", "cli_call5_dense.json", 5,
     PLANNED),
    ("cli_call5_dense.json", "olmo3", "sft's defaults", "cli_call5_dense.json", 5, PLANNED),
    ("cli_call5_dense.json", "smollm3", "sft's defaults", "cli_call5_dense.json", 5, PLANNED),
    ("cli_call5_dense.json", "gemma3", "sft's defaults (Liger)", "cli_call5_dense.json", 5, PLANNED),
    ("cli_call6_gemma4_auto.json", "gemma4", "sft_varlen per layer, 512-wide heads on efficient_varlen",
     "cli_call6_llama.json", 6, PLANNED),
    ("cli_call7_gemma4_compiled.json", "gemma4", "efficient_varlen and compiled decoder layers",
     "cli_call7_gemma4_compiled.json", 7, PLANNED),
    # mixtures of experts: MFU on the active experts' FLOPs
    ("cli_call8_moe.json", "gemma4_moe", "efficient_varlen, transformers' grouped_mm, eager layers",
     "cli_call8_moe.json", 8, PLANNED),
    ("cli_call8_moe.json", "qwen3_moe", "varlen FA2, grouped_mm, compiled layers", "cli_call8_moe.json", 8, PLANNED),
    ("cli_call8_moe.json", "gpt_oss", "flex_attention (sinks), sft_grouped experts, Liger", "cli_call8_moe.json", 8,
     PLANNED),
    ("cli_call8_moe.json", "glm4_moe", "varlen FA2, grouped_mm, eager layers", "cli_call8_moe.json", 8, PLANNED),
    ("cli_call12_glm4_moe_compiled.json", "glm4_moe", "varlen FA2, grouped_mm, compiled layers",
     "cli_call12_llama.json", 12, PLANNED),
    # call 14 ran no Llama: the Llama of call 11, the same machine held between the calls
    ("cli_call14_qwen3_5_moe_fla.json", "qwen3_5_moe", "fla varlen kernels (Triton 3.7.1), grouped_mm, eager layers",
     "cli_call11_llama.json", 14, PLANNED),
    ("cli_call15_glm4_moe_default.json", "glm4_moe", "varlen FA2, grouped_mm, eager layers", "cli_call15_llama.json",
     15, PLANNED),
    ("cli_call15_glm4_moe_compiled.json", "glm4_moe", "varlen FA2, grouped_mm, compiled layers (now)",
     "cli_call15_llama.json", 15, PLANNED),
    # Mixtral at 8 layers fits 80 GB since the plan counts the fused 8-bit step (no fp32 moments beside it)
    ("cli_call19_mixtral.json", "mixtral", "varlen FA2, grouped_mm, eager layers (now)", "cli_call19_mixtral.json",
     19, PLANNED),
    ("cli_call20_mixtral_compiled.json", "mixtral", "varlen FA2, grouped_mm, compile_decoder_layers: true",
     "cli_call20_llama.json", 20, PLANNED),
    # 1 x H100: the whole step with each kernel for the 512-wide heads (SFT_WIDE_HEADS), beside Llama
    ("cli_call25_gemma4_efficient.json", "gemma4", "efficient_varlen for the 512-wide heads, compiled layers",
     "cli_call25_llama.json", 25, PLANNED),
    ("cli_call25_gemma4_wide_varlen.json", "gemma4", "wide_varlen for the 512-wide heads, compiled layers (now)",
     "cli_call25_llama.json", 25, PLANNED),
    # call 27 ran Llama on call 26's machine, held warm between the calls (another H100 than call 25's)
    ("cli_call26_gemma4.json", "gemma4", "wide_varlen for the 512-wide heads, compiled layers (now; another H100)",
     "cli_call27_llama.json", 26, PLANNED),
    # 1 x H100, the image's Triton 3.6 (fla's backward piece that it refuses there through sft.model.fla_hopper);
    # Llama from call 28, the same machine held warm (call 29's Llama entry is call 28's run, refused as finished)
    ("cli_call29_qwen3_5_fla.json", "qwen3_5", "fla varlen kernels, Triton 3.6 with sft's dqkwg (now)",
     "cli_call28_llama.json", 29, PLANNED),
    ("cli_call30_qwen3_5_torch.json", "qwen3_5", "torch recurrence, batched, Triton 3.6 (before)",
     "cli_call28_llama.json", 30, PLANNED),
    # 1 x H100: FP8 with Liger under compiled layers (the token mixer out of their graph); the run of compiled layers
    # without Liger (the default since) was cut after step 5 and has no file here (the results' README, item 24)
    ("cli_call31_qwen3_5_fp8.json", "qwen3_5", "fla (Triton 3.6, sft's dqkwg), fp8: true, compiled layers, Liger",
     "cli_call31_llama.json", 31, PLANNED),
)  # fmt: skip


# (file under benchmarks/results/optimizer_step, its sets taken, the date): the newest measurement per card and set
STEPS = (
    ("h200_randint4x_call7.json", ("llama-3.2-1b", "qwen3-4b"), "2026-12-03"),
    ("h200_randint4x_call6.json", ("llama-3.1-8b",), "2026-12-03"),
    ("h100_step_call2.json", ("llama-3.2-1b",), "2026-12-07"),
)


def step_rows(folder: Path) -> list[dict]:
    rows = []
    for name, sets, date in STEPS:
        data = json.loads((folder / name).read_text())
        for row in (r for r in data["rows"] if r["set"] in sets):
            fp32 = row.get("torch_fused_fp32")
            rows.append({
                "set": row["set"], "parameters": row["parameters"], "card": data["card"], "date": date,
                "file": f"benchmarks/results/optimizer_step/{name}",
                "fused_8bit_sr_ms": round(row["fused_8bit_sr"], 2),
                "floor_8bit_ms": round(row["floor_ms_8bit"], 2),
                "fused_8bit_sr_x_floor": round(row["fused_8bit_sr"] / row["floor_ms_8bit"], 2),
                "torchao_8bit_sr_ms": round(row["torchao_8bit_sr"], 1),
                "torch_fused_fp32_x_floor": round(fp32 / row["floor_ms_fp32"], 2) if fp32 else None,
            })  # fmt: skip
    return rows


PLAN = re.compile(r"([\d,]+) tokens/s/GPU, MFU ([\d.]+)%.*peak ([\d.]+) GiB")


def estimate(run: dict) -> dict | None:
    """The plan's estimate for a run (the `chosen micro batch` line its log printed, kept by
    `benchmarks/architectures.py --cli` since 2026-12-07 evening) beside what the run measured; None for older runs."""
    found = PLAN.search(run.get("plan") or "")
    if not found:
        return None
    speed, mfu, peak = float(found[1].replace(",", "")), float(found[2]) / 100, float(found[3])
    return {"tokens_per_second": round(speed), "mfu": mfu, "peak_gib": peak,
            "speed_of_measured": round(speed / run["tokens_per_second"], 3),
            "peak_of_measured": round(peak / run["peak_memory_gib"], 3)}  # fmt: skip


def summary(folder: Path) -> dict:
    rows = []
    for name, family, path, llama_file, call, engine in RUNS:
        data = json.loads((folder / name).read_text())
        run, llama = data["families"][family], json.loads((folder / llama_file).read_text())["families"]["llama"]
        rows.append({
            "family": family, "path": path, "engine": engine, "layers": data["layers"],
            "card": data["environment"]["gpu"],
            "memory_cap_gib": 79.18, "device_call": call, "tokens_per_second": round(run["tokens_per_second"]),
            "mfu": round(run["mfu"], 4),
            "peak_gib": round(run["peak_memory_gib"], 1), "finite": run["finite"], "loss_fell": run["loss_fell"],
            "llama": {"tokens_per_second": round(llama["tokens_per_second"]), "mfu": round(llama["mfu"], 4),
                      "file": llama_file},
            "mfu_of_llama": round(run["mfu"] / llama["mfu"], 3), "trl": None, "estimate": estimate(run),
        })  # fmt: skip
    return {
        "source": "benchmarks/families_2026.py over " + ", ".join(sorted({r[0] for r in RUNS})),
        "rows": rows,
        "steps": step_rows(folder.parent / "optimizer_step"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("benchmarks/results/families_2026"))
    args = parser.parse_args()
    out = summary(args.folder)
    (args.folder / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    for r in out["steps"]:
        print(
            f"{r['set']:13} {r['card']:22} fused 8-bit + SR {r['fused_8bit_sr_ms']:6.2f} ms, "
            f"{r['fused_8bit_sr_x_floor']:.2f}x its floor; fp32 {r['torch_fused_fp32_x_floor'] or '-'}x"
        )
    for r in out["rows"]:
        print(
            f"{r['family']:8} {r['path'][:50]:50} {r['tokens_per_second']:>7,} tok/s  MFU {r['mfu']:.3f}  "
            f"{r['mfu_of_llama']:.2f} of Llama's {r['llama']['mfu']:.3f}  peak {r['peak_gib']} GiB"
        )


if __name__ == "__main__":
    main()
