"""QLoRA on the Llama-3.1-70B layer widths under ZeRO-3 with each GPU capped at 24 GiB: measured vs planned.

    python -m benchmarks.qlora_70b --layers 8 16 --out benchmarks/results/qlora_70b   # GPU machine
    python -m benchmarks.qlora_70b --layers 40 --gpus 2 --variants fit_2x24 nested --storage float8_e4m3fn \
        --out benchmarks/results/qlora_70b_2gpu                                        # 2 GPUs, loaded in host memory
    python -m benchmarks.qlora_70b --layers 40 --gpus 2 --variants zero3 fsdp2 --storage float8_e4m3fn \
        --out benchmarks/results/qlora_70b_fsdp2                                       # FSDP2 beside ZeRO-3
    python -m benchmarks.qlora_70b --report benchmarks/results/qlora_70b              # the table again

A random bf16 checkpoint of the 70B widths (hidden 8192, MLP 28672, 64 query / 8 KV heads, vocab 128256, untied) with
the largest `--layers` count is written shard by shard (`benchmarks.common.random_checkpoint`; no download, one layer
in memory at a time); smaller counts link its first layers. Each count trains with the real CLI: recipes/demo-lora.yaml
(LoRA r=16 on all linear layers, the demo's learnable synthetic tasks packed into rows of 2048 tokens),
`load_in_4bit` (NF4, bf16 compute), ds_configs/zero3.json, activation checkpointing, micro batch 1, and
`max_gpu_memory_gib: 24` (every allocation past 24 GiB fails as on a 24 GB card). Recorded per run: the loss curve,
peak allocated memory and tokens/s from metrics.jsonl, and `sft.plan.memory`'s peak for the same setting. The plan's
figure for the full 80 layers on 2 GPUs (`python -m sft.plan ... --gpus 2 --gpu-memory-gib 24 --suggest`) is written
beside them. The whole 70B does not fit this machine's disk as a bf16 checkpoint (140 GB); the layer counts that do are
measured, and the plan's per-layer terms checked against them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    LLAMA_SHAPES,
    ROOT,
    environment,
    fewer_layers,
    random_checkpoint,
    read_jsonl,
    run,
    sft_command,
    write_results,
)

CAP_GIB = 24
SEQ = 2048
LORA_R = 16
STEPS = 30

# DeepSpeed config and extra flags per variant. `offload_release`: parameter offload with DeepSpeed told to free every
# gathered parameter after use (`stage3_max_reuse_distance: 0`, at most 1e8 elements live), for the measured case
# where the default offload config keeps the 4-bit layers on the GPU.
VARIANTS = {
    "zero3": ("zero3.json", {}, []),
    "nested": ("zero3.json", {}, ["--use_bnb_nested_quant", "true"]),
    "offload": ("zero3_offload.json", {}, []),
    "offload_release": ("zero3_offload.json", {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 1e8},
                        []),
    # what `python -m sft.plan --suggest` answers for the full 70B on 2 x 24 GiB (with --qlora-nested)
    "fit_2x24": ("zero3_offload.json", {}, ["--use_bnb_nested_quant", "true", "--offload_checkpoints", "true"]),
    # FSDP2 (no DeepSpeed config): the 4-bit weights packed in bf16, loaded in host memory, sharded layer by layer
    "fsdp2": (None, {}, ["--engine", "fsdp2", "--deepspeed", "none"]),
}  # fmt: skip


def ds_config(work: Path, variant: str) -> Path | None:
    name, zero, _ = VARIANTS[variant]
    if name is None:
        return None
    config = json.loads((ROOT / "ds_configs" / name).read_text())
    config["zero_optimization"].update(zero)
    path = work / f"ds_{variant}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def train_args(model: Path, out: Path, ds: Path | None, extra: list[str], steps: int = STEPS) -> list[str]:
    return [
        "--config", str(ROOT / "recipes" / "demo-lora.yaml"), "--model_name_or_path", str(model),
        "--output_dir", str(out), "--load_in_4bit", "true", "--dtype", "bfloat16", "--bf16", "true",
        *(["--deepspeed", str(ds)] if ds else []), "--max_gpu_memory_gib", str(CAP_GIB),
        "--max_length", str(SEQ), "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
        "--activation_checkpointing", "true", "--lora_r", str(LORA_R), "--lora_alpha", str(2 * LORA_R),
        "--lora_dropout", "0", "--learning_rate", "1e-3", "--warmup_steps", "3", "--lr_scheduler_type", "constant",
        "--max_steps", str(steps), "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no",
        "--report_to", "none", *extra,
    ]  # fmt: skip


def planned(config: dict, layers: int, gpus: int, variant: str = "zero3") -> dict:
    from sft.model import shapes
    from sft.plan import memory as plan

    with tempfile.TemporaryDirectory() as tmp:
        shape = shapes.load_shape(str(write_config(Path(tmp), config, layers)))
    offload = variant.startswith("offload") or variant == "fit_2x24"
    setting = plan.Setting(gpus=gpus, zero_stage=3, micro_batch=1, seq_len=SEQ, activation_checkpointing=True,
                           liger=True, lora_r=LORA_R, qlora=True, qlora_nested=variant in ("nested", "fit_2x24"),
                           offload_optimizer=offload, offload_params=offload,
                           offload_checkpoints=variant == "fit_2x24",
                           engine="fsdp2" if variant == "fsdp2" else "deepspeed")  # fmt: skip
    e = plan.estimate(shape, setting)
    return {"layers": layers, "gpus": gpus, "variant": variant, "peak_gib": e.peak / plan.GiB,
            "train_gib": max(e.at_backward, e.at_step) / plan.GiB,
            "phase": e.peak_phase, "fits_24gib": e.fits(CAP_GIB * plan.GiB, 0.0), "table": e.table(),
            "setting": setting.describe()}  # fmt: skip


def measure(args) -> dict:
    config = {**LLAMA_SHAPES["llama-70b"], "num_hidden_layers": max(args.layers)}
    work = args.work
    start = time.time()
    source = random_checkpoint(work / f"llama70b_{max(args.layers)}layers", config, storage=args.storage)
    result = {"env": environment(), "cap_gib": CAP_GIB, "seq_len": SEQ, "lora_r": LORA_R, "steps": args.steps,
              "checkpoint_write_s": round(time.time() - start, 1), "runs": []}  # fmt: skip
    previous = args.out / "qlora_70b.json"  # runs of an earlier call are kept (one call cannot do every run)
    if previous.is_file():
        result["runs"] = json.loads(previous.read_text())["runs"]
    for variant in args.variants:
        for layers in sorted(args.layers):
            model = source if layers == max(args.layers) else fewer_layers(source, work / f"llama70b_{layers}", layers)
            name = f"{layers}_{variant}" + (f"_{args.gpus}gpu" if args.gpus > 1 else "")
            out = work / f"run_{name}"
            extra = VARIANTS[variant][2]
            cmd = sft_command(args.gpus, train_args(model, out, ds_config(work, variant), extra, args.steps))
            rc, seconds = run(cmd, args.out / f"run_{name}.log")
            rows = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
            steps = [r for r in rows if "loss" in r]
            timed = steps[3:]  # after warm-up
            run_result = {
                "layers": layers, "variant": variant, "gpus": args.gpus, "exit_code": rc, "wall_s": round(seconds, 1),
                "losses": [r["loss"] for r in steps],
                # the whole run's peak (the model build's included), as the plan's peak is; and training's alone
                "peak_memory_gib": max((max(r.get("peak_memory_gib", 0), r.get("setup_peak_memory_gib", 0))
                                        for r in steps), default=None),
                "train_peak_memory_gib": max((r.get("peak_memory_gib", 0) for r in steps), default=None),
                "setup_peak_memory_gib": max((r.get("setup_peak_memory_gib", 0) for r in steps), default=None),
                "tokens_per_second_per_gpu": sum(r["tokens_per_second_per_gpu"] for r in timed) / len(timed)
                if timed else None,
            }  # fmt: skip
            key = (layers, variant, args.gpus)
            result["runs"] = [r for r in result["runs"] if (r["layers"], r["variant"], r.get("gpus", 1)) != key]
            result["runs"].append(run_result)
            print(f"{name}: exit {rc}, {seconds:.0f} s, peak {run_result['peak_memory_gib']}", flush=True)
            report(result, args.out)
    if args.merge:
        variant = args.merge_variant or args.variants[-1]
        model = fewer_layers(source, work / f"llama70b_{args.merge}", args.merge)
        out = work / f"run_{args.merge}_{variant}_merge"
        cmd = sft_command(args.gpus, train_args(model, out, ds_config(work, variant), VARIANTS[variant][2], 6))
        rc, _ = run(cmd, args.out / f"run_{args.merge}_{variant}_merge.log")
        try:
            result["merge"] = merged(out, model, args.out) if rc == 0 else {"layers": args.merge, "train_exit": rc}
        except Exception as e:  # noqa: BLE001 - the training runs' results are still written
            result["merge"] = {"layers": args.merge, "error": repr(e)}
        print(f"merge: {result['merge']}", flush=True)
    result["plan_80_layers_2_gpus"] = {}
    report(result, args.out)
    return result


def merged(run_dir: Path, base: Path, out: Path) -> dict:
    """`sft merge` of the adapter a QLoRA run saved into its bf16 base, then the merged directory loaded: a query
    projection of it against the base's plus the adapter's own B @ A x alpha / r, and a few greedy tokens."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target = run_dir.parent / f"{run_dir.name}_merged"
    rc, seconds = run([sys.executable, "-m", "sft.tools.merge", "--adapter", str(run_dir), "--output", str(target),
                       "--dtype", "bfloat16"], out / f"{run_dir.name}.log")  # fmt: skip
    if rc:
        return {"merge_exit_code": rc}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16, device_map="cuda")
    name = "model.layers.0.self_attn.q_proj.weight"
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(base / index[name], "pt") as f:
        before = f.get_tensor(name).to(torch.bfloat16).float()
    adapter = load_file(run_dir / "adapter_model.safetensors")
    config = json.loads((run_dir / "adapter_config.json").read_text())
    key = "base_model.model." + name.removesuffix(".weight")
    a, b = (adapter[f"{key}.lora_{x}.weight"].float() for x in "AB")
    expected = b @ a * config["lora_alpha"] / config["r"]
    change = model.get_parameter(name).float().cpu() - before
    tokens = model.generate(torch.tensor([[1, 2, 3, 4]], device="cuda"), max_new_tokens=8, do_sample=False)
    return {"layers": json.loads((base / "config.json").read_text())["num_hidden_layers"], "merge_exit_code": rc,
            "merge_s": round(seconds, 1), "adapter_delta_norm": expected.norm().item(),
            "merged_minus_base_vs_delta_rel_error": (change - expected).norm().item() / expected.norm().item(),
            "generated": tokens[0].tolist()}  # fmt: skip


def write_config(work: Path, config: dict, layers: int) -> Path:
    path = work / f"config_{layers}.json"
    path.write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return path


def report(result: dict, out: Path) -> None:
    """The table, with the plan figures of this commit's `sft.plan.memory` (they are recomputed, not read back)."""
    config = LLAMA_SHAPES["llama-70b"]
    for r in result["runs"]:
        r["plan"] = planned(config, r["layers"], r.get("gpus", 1), r["variant"])
    if "plan_80_layers_2_gpus" in result:  # the full model on 2 GPUs of 24 GiB, as `sft.plan.memory` answers today
        with tempfile.TemporaryDirectory() as tmp:
            cli = subprocess.run(
                [sys.executable, "-m", "sft.plan", "--model", str(write_config(Path(tmp), config, 80)), "--gpus",
                 "2", "--zero", "3", "--lora-r", str(LORA_R), "--qlora", "--qlora-nested",
                 "--activation-checkpointing", "--liger", "--seq-len", str(SEQ), "--gpu-memory-gib", str(CAP_GIB),
                 "--suggest"], cwd=ROOT, capture_output=True, text=True,
            )  # fmt: skip
        lines_cli = [line for line in cli.stdout.splitlines() if not line.startswith((str(tmp), "["))]
        result["plan_80_layers_2_gpus"] = planned(config, 80, 2, "nested") | {"cli": "\n".join(lines_cli)}
    lines = [
        f"# QLoRA, Llama-3.1-70B widths, sharded, GPU capped at {result['cap_gib']} GiB ({result['env']['device']})",
        "",
        f"LoRA r={result['lora_r']} on all linear layers over NF4 weights (bf16 compute, packed in bf16), rows of "
        f"{result['seq_len']} tokens, activation checkpointing, micro batch 1, {result['steps']} steps on the demo's "
        "synthetic tasks; `max_gpu_memory_gib: 24`. Peak: `torch.cuda.max_memory_allocated()`; plan: "
        "`sft.plan.memory` for the same setting (this commit's). Variants: `zero3` ds_configs/zero3.json; `nested` "
        "the same with `use_bnb_nested_quant`; `offload` ds_configs/zero3_offload.json (optimizer and parameters in "
        "CPU memory); `offload_release` that with `stage3_max_reuse_distance: 0`, `stage3_max_live_parameters: 1e8`; "
        "`fsdp2` `engine: fsdp2` (no DeepSpeed config; the plan in ZeRO-3's layout).",
        "",
        "| decoder layers | variant | GPUs | exit | loss first 3 -> last 3 (mean) | tokens/s/GPU | peak GiB | "
        "plan GiB | plan error | plan phase | training peak GiB | plan, training |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(result["runs"], key=lambda r: (r.get("gpus", 1), list(VARIANTS).index(r["variant"]), r["layers"])):
        losses = r["losses"]
        curve = f"{sum(losses[:3]) / 3:.3f} -> {sum(losses[-3:]) / 3:.3f}" if len(losses) >= 6 else "-"
        peak, plan_peak = r["peak_memory_gib"], r["plan"]["peak_gib"]
        error = f"{100 * (plan_peak - peak) / peak:+.1f}%" if peak else "-"
        tps = f"{r['tokens_per_second_per_gpu']:,.0f}" if r["tokens_per_second_per_gpu"] else "-"
        train = f"{r['train_peak_memory_gib']:.2f}" if r.get("train_peak_memory_gib") else "-"
        lines.append(
            f"| {r['layers']} | {r['variant']} | {r.get('gpus', 1)} | {r['exit_code']} | {curve} | {tps} | "
            f"{peak or 0:.2f} | {plan_peak:.2f} | {error} | {r['plan']['phase']} | {train} | "
            f"{r['plan']['train_gib']:.2f} |"
        )
    notes = [f"- {r['layers']} layers, {r['variant']}: {r['note']}" for r in result["runs"] if r.get("note")]
    if notes:
        lines += ["", *notes]
    if result.get("merge"):
        lines += ["", f"Merge (`sft merge`, the last variant trained 6 steps on fewer layers): {result['merge']}"]
    full = result.get("plan_80_layers_2_gpus")
    if full:
        lines += ["", f"Plan, all 80 layers on 2 GPUs (nested quantization): peak {full['peak_gib']:.2f} GiB "
                  f"({'fits' if full['fits_24gib'] else 'does not fit'} in {result['cap_gib']} GiB).", "",
                  "```", full["cli"].strip(), "```"]  # fmt: skip
    write_results(out, "qlora_70b", result, "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12])
    parser.add_argument("--variants", nargs="+", default=["zero3"], choices=list(VARIANTS))
    parser.add_argument("--gpus", type=int, default=1, help="Processes per run (one per GPU)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--storage", default="bfloat16", help="float8_e4m3fn: the random checkpoint in half the disk")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "qlora_70b")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "qlora_70b")
    parser.add_argument("--report", type=Path, help="Rewrite the table from a results folder")
    parser.add_argument(
        "--merge",
        type=int,
        metavar="LAYERS",
        help="Also train the last variant on this many layers for 6 steps, merge its adapter, load it",
    )
    parser.add_argument("--merge-variant", choices=list(VARIANTS), help="What --merge trains (default: the last)")
    args = parser.parse_args()
    if args.report:
        report(json.loads((args.report / "qlora_70b.json").read_text()), args.report)
        return
    measure(args)


if __name__ == "__main__":
    main()
