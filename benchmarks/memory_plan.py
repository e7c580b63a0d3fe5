"""Predicted (`sft.plan.memory`) vs measured peak GPU memory of real sft training steps; JSON + markdown out.

    python -m benchmarks.memory_plan --set calibration --out benchmarks/results    # measure (GPUs), then compare
    python -m benchmarks.memory_plan --report benchmarks/results/memory_plan_calibration_measured.json  # again

Each group (model shape, ZeRO stage, GPU count, Liger) is one `torchrun` launch of the real trainer: the recipe goes
through `sft.plan.arguments.parse_args`, the data through `sft.data.load`, the model through `sft.model.build`,
training through `sft.run.trainer.Trainer` with DeepSpeed. The run is cut into phases of a few optimizer steps; a
callback switches activation checkpointing and the data holds micro-batches of the phase's token count (padding-free:
one row of micro_batch x max_length tokens), so one model build measures many settings. For every step it records
`torch.cuda.max_memory_allocated()` over forward + backward and over DeepSpeed's optimizer step, the maximum over
ranks. Models are built from their config (random weights): memory does not depend on the weights' values.

The measured rows are written first (`memory_plan_<set>_measured.json`), then each row is compared with
`sft.plan.memory.estimate` for the same setting (`memory_plan_<set>.{json,md}`); `--auto-check` checks the CLI's `auto`
choice (`memory_plan_auto.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import LLAMA_SHAPES, ROOT, model_dir, random_checkpoint, run, sft_command, torchrun

SHAPES = dict(LLAMA_SHAPES)
# (shape, zero stage, GPUs, liger, max_length, phases as (activation checkpointing, micro batch)); a phase of micro
# batch m trains micro-batches of m x max_length tokens. `calibration` is what sft.plan.memory's per-token allowance
# was fitted on; `validation` was measured afterwards, with shapes, lengths and GPU counts the fit never saw.
SETS = {
    "calibration": [
        ("llama-1b", 2, 2, True, 2048, [(False, 1), (False, 2), (False, 4), (True, 1), (True, 4), (True, 8)]),
        ("llama-1b", 3, 2, True, 2048, [(False, 1), (False, 2), (False, 4), (True, 1), (True, 4), (True, 8)]),
        ("llama-1b", 2, 2, False, 2048, [(False, 1), (False, 4), (True, 4)]),
        ("llama-8b", 2, 2, True, 2048, [(False, 1), (False, 2), (True, 2), (True, 8)]),
        ("llama-8b", 3, 2, True, 2048, [(False, 1), (False, 2), (True, 2), (True, 8)]),
    ],
    "validation": [
        ("llama-3b", 3, 2, True, 4096, [(False, 1), (False, 2), (True, 1), (True, 4)]),
        ("llama-3b", 2, 2, True, 4096, [(False, 1), (True, 4)]),
        ("llama-1b", 2, 1, True, 4096, [(False, 1), (False, 2), (True, 4)]),
        ("llama-8b", 3, 2, False, 4096, [(False, 1), (True, 1), (True, 4)]),
    ],
}
# LoRA r=16 on all linear layers of a saved random checkpoint; QLoRA: its linears in 4-bit NF4 (bf16 compute, packed
# in bf16 under ZeRO-3). One GPU (the machine lent then); each launch keeps one checkpointing setting (TRL sets
# PEFT + ZeRO-3 checkpointing up at start: reentrant, input gradients) and measures micro batches 1 and 2.
SETS["lora"] = [
    ("llama-3b", stage, 1, True, 2048, [(ckpt, 1), (ckpt, 2)], method)
    for method in ("qlora", "lora")
    for stage in (2, 3)
    for ckpt in (True, False)
]
LORA_R = 16
LORA_DROPOUT = 0.05  # TRL's ModelConfig default, which the recipe keeps
STEPS_PER_PHASE = 2


def worker(args) -> None:
    """One torchrun rank: train through sft's own stack, switching settings by phase, and record peak memory."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    from sft.core import logs
    from sft.data.load import load_datasets
    from sft.model.build import load_model, load_tokenizer
    from sft.parallel.distributed import init_process_group
    from sft.plan.arguments import parse_args
    from sft.run.trainer import Trainer

    cuda = torch.cuda.is_available()  # on CPU (a smoke test of this script) every figure reads 0
    sync = torch.cuda.synchronize if cuda else lambda: None
    allocated = torch.cuda.memory_allocated if cuda else lambda: 0
    peak = torch.cuda.max_memory_allocated if cuda else lambda: 0
    reset = torch.cuda.reset_peak_memory_stats if cuda else lambda: None
    phases = json.loads(args.phases)
    init_process_group()
    script_args, data_args, training_args, model_args = parse_args(["--config", str(args.recipe)])
    logs.setup(training_args)
    train_dataset, _ = load_datasets(script_args, data_args, training_args)
    tokenizer = load_tokenizer(model_args, training_args)
    model = load_model(model_args, training_args)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    current: dict = {}

    original_step = deepspeed.runtime.engine.DeepSpeedEngine.step

    def step(self, *a, **kw):  # split the step's peak into forward+backward and the optimizer step
        sync()
        current["peak_fwd_bwd"], current["before_step"] = peak(), allocated()
        reset()
        out = original_step(self, *a, **kw)
        sync()
        current["peak_step"] = peak()
        return out

    deepspeed.runtime.engine.DeepSpeedEngine.step = step

    switches = len({c for c, _ in phases}) > 1  # checkpointing switched between phases

    class Probe(TrainerCallback):
        def on_train_begin(self, args_, state, control, **kw):
            current["train_begin"] = allocated()

        def on_step_begin(self, args_, state, control, model=None, **kw):
            ckpt, micro = phases[state.global_step // STEPS_PER_PHASE]
            module = getattr(model, "module", model)
            if not switches:  # one setting for the whole launch: as the trainer set it up
                pass
            elif ckpt:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                module.gradient_checkpointing_disable()
            sync()
            current["step_begin"] = allocated()
            reset()

        def on_step_end(self, args_, state, control, **kw):
            ckpt, micro = phases[(state.global_step - 1) // STEPS_PER_PHASE]
            keys = ["train_begin", "step_begin", "peak_fwd_bwd", "before_step", "peak_step"]
            values = torch.tensor([float(current[k]) for k in keys], device="cuda" if cuda else "cpu")
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            if training_args.process_index == 0:
                row = dict(zip(keys, values.tolist(), strict=True))
                row.update(step=state.global_step, activation_checkpointing=ckpt, micro_batch=micro, n_params=n_params)
                with open(args.rows, "a") as f:
                    f.write(json.dumps(row) + "\n")

    from trl import get_peft_config

    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, processing_class=tokenizer,
                      callbacks=[Probe()], fingerprint={}, peft_config=get_peft_config(model_args))  # fmt: skip
    trainer.train()


def measure(args) -> dict:
    import numpy as np
    import yaml

    work = Path(tempfile.mkdtemp(prefix="memory_plan_"))
    header, groups, report = _header(), [], {}
    groups_to_run = SETS[args.set]
    if args.tiny:  # CPU smoke test of the whole script: the demo shape, fp32, no Liger
        SHAPES["tiny"] = json.loads((ROOT / "recipes" / "demo" / "model" / "config.json").read_text())
        groups_to_run = [("tiny", stage, 2, False, 64, [(False, 1), (True, 2)]) for stage in (2, 3)]
        if args.set == "lora":
            groups_to_run = [("tiny", stage, 2, False, 64, [(True, 1), (True, 2)], "qlora") for stage in (2, 3)]
    for shape, stage, gpus, liger, seq, phases, *rest in groups_to_run:
        if args.only and shape not in args.only:
            continue
        method = rest[0] if rest else "full"
        ckpts = "".join(sorted({"c" if c else "n" for c, _ in phases}))
        name = f"{shape}_zero{stage}_{gpus}gpu_liger{int(liger)}" + (f"_{method}_{ckpts}" if rest else "")
        if args.match and args.match not in name:
            continue
        if method == "full":
            model = model_dir(work / shape, SHAPES[shape])
        else:  # LoRA needs saved base weights (from_scratch ones are never saved)
            model = random_checkpoint(work / f"{shape}_weights", SHAPES[shape])
        rng = np.random.default_rng(0)
        data = work / f"{name}.jsonl"
        with open(data, "w") as f:  # the sequential sampler hands rank r item (step * gpus + r)
            for _, micro in phases:
                for _ in range(STEPS_PER_PHASE * gpus):
                    ids = rng.integers(10, SHAPES[shape]["vocab_size"], size=micro * seq).tolist()
                    f.write(json.dumps({"input_ids": ids}) + "\n")
        recipe = {
            "model_name_or_path": str(model), "from_scratch": True, "dtype": "bfloat16", "bf16": True,
            "datasets": [{"path": str(data)}], "packing": False, "padding_free": True,
            "max_length": None, "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 1, "max_steps": len(phases) * STEPS_PER_PHASE,
            "train_sampling_strategy": "sequential", "learning_rate": 1e-5, "lr_scheduler_type": "constant",
            "logging_steps": 1, "save_strategy": "no", "eval_strategy": "no", "report_to": "none",
            "use_liger_kernel": liger, "deepspeed": str(ROOT / "ds_configs" / f"zero{stage}.json"),
            "attn_implementation": "auto", "activation_checkpointing": False, "output_dir": str(work / name / "out"),
            "dataloader_num_workers": 0, "seed": 0,
        }  # fmt: skip
        if method != "full":
            recipe.update(from_scratch=False, use_peft=True, lora_r=LORA_R, lora_alpha=2 * LORA_R,
                          lora_target_modules="all-linear", load_in_4bit=method == "qlora",
                          activation_checkpointing=phases[0][0])  # fmt: skip
        if args.tiny:
            recipe.update(bf16=False, dtype="float32")
        (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        rows = work / f"{name}.rows.jsonl"
        cmd = [*torchrun(gpus), "-m", "benchmarks.memory_plan", "--worker", "--recipe", str(work / f"{name}.yaml")]
        cmd += ["--rows", str(rows), "--phases", json.dumps([[c, m] for c, m in phases])]
        start = time.time()
        rc, _ = run(cmd, work / f"{name}.log")
        steps = [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []
        group = {"name": name, "shape": shape, "config": SHAPES[shape], "zero_stage": stage, "gpus": gpus,
                 "liger": liger, "seq_len": seq, "method": method, "exit_code": rc,
                 "wall_s": round(time.time() - start, 1), "steps": steps}  # fmt: skip
        if rc != 0:
            group["log_tail"] = (work / f"{name}.log").read_text()[-4000:]
        print(f"{name}: exit {rc}, {group['wall_s']} s, {len(group['steps'])} steps", flush=True)
        groups.append(group)
        report = header | {"groups": groups}
        args.out.mkdir(parents=True, exist_ok=True)  # after every group, so a cut-off run keeps what it measured
        name = f"memory_plan_{args.set}_measured{'_tiny' if args.tiny else ''}.json"
        (args.out / name).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _header() -> dict:
    import deepspeed
    import torch
    import transformers

    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0,
        "versions": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
        },  # fmt: skip
        "date": time.strftime("%Y-%m-%d"),
        "steps_per_phase": STEPS_PER_PHASE,
    }


def auto_check(args) -> None:
    """The real CLI with `auto` micro batch and checkpointing: what the plan chose, and the peak the run reached."""
    import numpy as np
    import yaml

    work = Path(tempfile.mkdtemp(prefix="memory_plan_auto_"))
    shape, gpus, memory_gib, seq, global_batch = "llama-8b", 2, 80.0, 4096, 16
    model = model_dir(work / shape, SHAPES[shape])
    rng = np.random.default_rng(0)
    with open(work / "data.jsonl", "w") as f:
        for length in np.clip(rng.lognormal(np.log(1500), 0.8, size=400), 64, seq).astype(int):
            f.write(json.dumps({"input_ids": rng.integers(10, SHAPES[shape]["vocab_size"], size=length).tolist()}))
            f.write("\n")
    recipe = {
        "model_name_or_path": str(model), "from_scratch": True, "dtype": "bfloat16", "bf16": True,
        "datasets": [{"path": str(work / "data.jsonl")}], "packing": True, "max_length": seq,
        "per_device_train_batch_size": "auto", "activation_checkpointing": "auto", "global_batch_size": global_batch,
        "plan_gpu_memory_gib": memory_gib, "max_steps": 4, "logging_steps": 1, "save_strategy": "no",
        "eval_strategy": "no", "report_to": "none", "use_liger_kernel": True, "learning_rate": 1e-5,
        "deepspeed": str(ROOT / "ds_configs" / "zero3.json"), "output_dir": str(work / "out"), "seed": 0,
    }  # fmt: skip
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cmd = sft_command(gpus, ["--config", str(work / "recipe.yaml")])
    start = time.time()
    returncode, _ = run(cmd, work / "auto.log")
    log = (work / "auto.log").read_text()
    metrics = work / "out" / "metrics.jsonl"
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] if metrics.exists() else []
    result = {
        "command": " ".join(cmd[1:]), "recipe": recipe, "exit_code": returncode,
        "wall_s": round(time.time() - start, 1),
        "plan_log": [line for line in log.splitlines() if "plan" in line.lower() or "auto settings" in line
                     or line.startswith("  ")][:40],
        "peak_memory_gib": max((r.get("peak_memory_gib", 0.0) for r in steps), default=None),
        "losses": [r["loss"] for r in steps],
    }  # fmt: skip
    if returncode:
        result["log_tail"] = log[-4000:]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_plan_auto.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "recipe"}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--report", type=Path, help="Compare an existing measured JSON with sft.plan.memory, no GPU needed"
    )
    parser.add_argument("--auto-check", action="store_true", help="Run sft/train.py with auto micro batch/ckpt")
    parser.add_argument("--set", choices=sorted(SETS), default="validation", help="Which matrix to measure")
    parser.add_argument("--match", help="Only the groups whose name holds this, e.g. zero3_1gpu_liger1_lora_")
    parser.add_argument("--tiny", action="store_true", help="Demo shape in fp32 on CPU: a smoke test of the script")
    parser.add_argument("--only", nargs="*", help="Shapes to measure (default: all groups)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--phases", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.auto_check:
        auto_check(args)
        return
    measured = json.loads(args.report.read_text()) if args.report else measure(args)
    if measured["device"] == "cpu":
        return  # the CPU smoke test measures nothing to compare
    tag = args.report.stem.replace("_measured", "") if args.report else f"memory_plan_{args.set}"
    report(measured, args.out, tag + ("_tiny" if args.tiny else ""))


def report(measured: dict, out: Path, tag: str) -> None:
    """Compare every measured phase with sft.plan.memory's prediction; write <tag>.json and <tag>.md."""
    from sft.model import shapes
    from sft.plan import memory as plan

    rows = []
    for group in measured["groups"]:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(group["config"], f)
        shape = shapes.load_shape(f.name)
        os.unlink(f.name)
        phases: dict = {}
        for step in group["steps"]:
            phases.setdefault((step["activation_checkpointing"], step["micro_batch"]), []).append(step)
        for (ckpt, micro), steps in phases.items():
            lora = group.get("method", "full") != "full"
            setting = plan.Setting(
                gpus=group["gpus"], zero_stage=group["zero_stage"], micro_batch=micro, seq_len=group["seq_len"],
                activation_checkpointing=ckpt, liger=group["liger"], lora_r=LORA_R if lora else 0,
                qlora=group.get("method") == "qlora", lora_dropout=LORA_DROPOUT if lora else 0.0,
            )  # fmt: skip
            e = plan.estimate(shape, setting)
            fwd_bwd = max(s["peak_fwd_bwd"] for s in steps)
            opt_step = max(s["peak_step"] for s in steps)
            peak = max(fwd_bwd, opt_step)
            rows.append({
                "group": group["name"], "shape": group["shape"], "method": group.get("method", "full"),
                "zero_stage": group["zero_stage"],
                "gpus": group["gpus"], "liger": group["liger"], "activation_checkpointing": ckpt,
                "micro_batch": micro, "seq_len": group["seq_len"],
                "measured_peak_gib": peak / plan.GiB, "predicted_peak_gib": e.peak / plan.GiB,
                "error_pct": 100 * (e.peak - peak) / peak, "predicted_phase": e.peak_phase,
                "measured_fwd_bwd_gib": fwd_bwd / plan.GiB, "predicted_fwd_bwd_gib": e.at_backward / plan.GiB,
                "measured_step_gib": opt_step / plan.GiB, "predicted_step_gib": e.at_step / plan.GiB,
            })  # fmt: skip
    worst = max(abs(r["error_pct"]) for r in rows)
    worst_fb = max(
        abs(r["predicted_fwd_bwd_gib"] - r["measured_fwd_bwd_gib"]) / r["measured_fwd_bwd_gib"] * 100 for r in rows
    )
    result = {k: v for k, v in measured.items() if k != "groups"} | {
        "rows": rows, "max_abs_error_pct": worst, "max_abs_fwd_bwd_error_pct": worst_fb,
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Memory plan vs measured peak ({tag}): {measured['device']}, bf16, AdamW",
        "",
        f"Measured: `torch.cuda.max_memory_allocated()`, max over ranks and over the {measured['steps_per_phase']} "
        "optimizer steps of each setting, through sft's trainer with DeepSpeed. Predicted: "
        "`sft.plan.memory.estimate`. "
        f"Versions: {measured['versions']}.",
        "",
        "| model | method | ZeRO | GPUs | Liger | act. ckpt | micro x max_length | measured GiB | predicted GiB | "
        "error | fwd+bwd meas. / pred. | step meas. / pred. |",
        "|" + " --- |" * 12,
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['zero_stage']} | {r['gpus']} | {'on' if r['liger'] else 'off'} | "
            f"{'on' if r['activation_checkpointing'] else 'off'} | {r['micro_batch']} x {r['seq_len']} | "
            f"{r['measured_peak_gib']:.2f} | "
            f"{r['predicted_peak_gib']:.2f} | {r['error_pct']:+.1f}% | {r['measured_fwd_bwd_gib']:.2f} / "
            f"{r['predicted_fwd_bwd_gib']:.2f} | {r['measured_step_gib']:.2f} / {r['predicted_step_gib']:.2f} |"
        )
    lines += ["", f"Largest error of the peak: {worst:.1f}%; of the forward+backward peak alone: {worst_fb:.1f}%."]
    (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
