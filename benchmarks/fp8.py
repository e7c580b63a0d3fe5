"""FP8 (torchao float8, `sft.model.fp8`) against sft's bf16 default: throughput, loss curves, resume; one script.

    python -m benchmarks.fp8 --parts throughput --out $OUT                  # 1B and 3B shapes, 1 GPU, ZeRO-2
    python -m benchmarks.fp8 --parts 8b_2gpu --out $OUT                     # Llama-3.1-8B on 2 GPUs, ZeRO-2 and ZeRO-3
    python -m benchmarks.fp8 --parts zero3,accuracy,resume --out $OUT       # 8B widths under ZeRO-3/2; 300-step loss
                                                                            # curves; kill + resume with FP8
    python -m benchmarks.fp8 --parts accuracy --against adam8 --out $OUT    # the same curves: 8-bit Adam vs fp32
    python -m benchmarks.fp8 --report DIR [DIR ...] --out benchmarks/results/fp8   # merge calls into one report
    SFT_FP8_ON_CPU=1 python -m benchmarks.fp8 --tiny --parts throughput,accuracy,resume --out /tmp/f   # CPU smoke

Every run is the real CLI (`sft/train.py` under torchrun), random-initialised Llama shapes.

- `throughput`: seq 4096, pre-tokenised SFT-like data (`benchmarks.common.make_sft_data`), packing, global batch 32
  rows, the micro batch and checkpointing of the memory plan (`auto`), Liger; settings side by side in one call:
  `bf16` (sft's default, `fp8: false`), `fp8_rowwise` and `fp8_tensorwise` (decoder layers compiled, as `fp8: true`
  does), `fp8_rowwise_eager` (not compiled). Tokens/s per GPU and MFU are read from metrics.jsonl after warm-up
  steps; MFU is against the dense bf16 peak in every row.
- `zero3`: the Llama-3.1-8B layer widths with 8 of its 32 layers (fits one GPU with its optimizer states), ZeRO-3 and
  ZeRO-2, bf16 vs FP8.
- `accuracy`: the 1B widths with the demo's character tokenizer, trained on the demo's four string tasks (200,000
  records, loss on every token: the random prompt letters keep the loss far from 0, the answers are learnt), 300
  steps of 8 packed rows of 2,048 tokens, bf16 and FP8 at once on the one GPU, the same seed and data. Reported: the
  relative difference of the last-50-step mean loss, and a plot of both curves (`accuracy.png`). `--against adam8`
  runs the same curve for torchao's 8-bit AdamW (`optim: adamw_torch_8bit`, bf16) against fp32 Adam instead (issue
  #53's optimizer-state lever).
- `resume`: FP8 runs of a small model (hidden 2048, 4 layers): two uninterrupted, one SIGKILLed while writing a
  checkpoint and rerun (as `benchmarks.resume_exactness`); per-step loss/grad-norm differences and final weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks import throughput
from benchmarks.common import (
    LLAMA_SHAPES,
    ROOT,
    environment,
    make_sft_data,
    model_dir,
    read_jsonl,
    sft_command,
    start,
    write_results,
)
from benchmarks.resume_exactness import compare

SHAPES = {
    "1b": LLAMA_SHAPES["llama-1b"],
    "3b": LLAMA_SHAPES["llama-3b"],
    "8b-l8": {**LLAMA_SHAPES["llama-8b"], "num_hidden_layers": 8},
    "8b": LLAMA_SHAPES["llama-8b"],
}
SETTINGS = {
    "bf16": {"fp8": False},
    "fp8_rowwise": {"fp8": True, "fp8_recipe": "rowwise"},
    "fp8_tensorwise": {"fp8": True, "fp8_recipe": "tensorwise"},
    "fp8_rowwise_eager": {"fp8": True, "fp8_recipe": "rowwise", "compile_decoder_layers": False},
    "fp8_tensorwise_eager": {"fp8": True, "fp8_recipe": "tensorwise", "compile_decoder_layers": False},
    "fp8_tensorwise_compiled": {"fp8": True, "fp8_recipe": "tensorwise", "compile_decoder_layers": True},
    "adam8": {"fp8": False, "optim": "adamw_torch_8bit"},  # Adam's moments in torchao's 8-bit blocks
    "fp8_tensorwise_no_liger_swiglu": {
        "fp8": True,
        "fp8_recipe": "tensorwise",
        "compile_decoder_layers": True,
        "liger_kernel_config": {"swiglu": False},
    },
}
PARTS = {
    "throughput": [("1b", "zero2", s) for s in ("bf16", "fp8_rowwise", "fp8_tensorwise")]
    + [("3b", "zero2", s) for s in ("bf16", "fp8_rowwise", "fp8_tensorwise")]
    + [("1b", "zero2", "fp8_rowwise_eager")],
    "zero3": [("8b-l8", "zero3", s) for s in ("bf16", "fp8_tensorwise")]
    + [("8b-l8", "zero2", s) for s in ("bf16", "fp8_tensorwise")],
    # the Llama-3.1-8B shape, whole, on 2 GPUs (in order of importance: a call's budget may cut the last)
    "8b_2gpu": [
        ("8b", "zero2", "bf16", 2),
        ("8b", "zero2", "fp8_tensorwise", 2),
        ("8b", "zero3", "bf16", 2),
        ("8b", "zero3", "fp8_tensorwise_compiled", 2),
        ("8b", "zero3", "fp8_tensorwise_no_liger_swiglu", 2),
    ],
}
ACCURACY_STEPS, ACCURACY_TAIL = 300, 50
FAILURES = {  # what a failed run's log tail says, in short
    "No space left on device": "the final save filled the machine's disk",
    "overwrite_tensor_vt_proxy": "torch.compile failed (dynamo AssertionError on Liger's SwiGLU under ZeRO-3)",
}


def recipe_for(args, model: Path, data: Path, out: Path, setting: str, stage: str, **extra) -> dict:
    recipe = {**throughput.COMMON, "packing": True, "global_batch_size": throughput.GLOBAL_BATCH, **SETTINGS[setting]}
    recipe.update(model_name_or_path=str(model), datasets=[{"path": str(data)}], output_dir=str(out))
    recipe.update({"max_steps": args.steps, "deepspeed": str(ROOT / throughput.STAGES[stage]), **extra})
    if args.tiny:
        recipe.update(bf16=False, dtype="float32", max_length=512, peak_tflops=1.0, global_batch_size=4)
    return recipe


def launch(args, work: Path, name: str, recipe: dict, env: dict | None = None, gpus: int = 1):
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    cmd = sft_command(gpus, ["--config", str(work / f"{name}.yaml")])
    return start(cmd, work / "logs" / f"{name}.log", env)


def speed_part(args, work: Path, part: str) -> None:
    data = work / "data.jsonl"
    if not data.exists():
        make_sft_data(data, args.records, 104 if args.tiny else SHAPES["1b"]["vocab_size"], 512 if args.tiny else 4096)
    for shape, stage, setting, *gpus in PARTS[part]:
        gpus = gpus[0] if gpus else 1
        if time.time() - args.t0 > args.budget:
            print(f"budget of {args.budget} s spent: {shape}-{gpus}gpu-{stage}-{setting} not run", flush=True)
            continue
        name = f"{shape}-{gpus}gpu-{stage}-{setting}"
        model = model_dir(work / f"model-{shape}", None if args.tiny else SHAPES[shape])
        proc = launch(args, work, name, recipe_for(args, model, data, work / name, setting, stage), gpus=gpus)
        run = {"name": name, "model": shape, "gpus": gpus, "stage": stage, "setting": setting, "part": part}
        result = throughput.collect(run, proc, args, work, [name])
        log = (work / "logs" / f"{name}.log").read_text()
        result["fp8_log"] = [line.split("sft.", 1)[-1] for line in log.splitlines() if "FP8: " in line][:6]
        with open(args.out / "runs.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        mfu = f"{result['mfu']:.3f}" if result.get("mfu") is not None else "-"
        print(f"  {name}: exit {result['exit_code']}, {result['wall_s']} s, "
              f"{result.get('tokens_per_second_per_gpu', 0):.0f} tokens/s/GPU, MFU {mfu}, "
              f"peak {result.get('peak_memory_gib', 0):.1f} GiB", flush=True)  # fmt: skip


def demo_data(path: Path, n: int) -> None:
    from sft.tools.demo import make_records

    train, _ = make_records(n, 0, seed=1)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)


def accuracy_part(args, work: Path) -> None:
    data = work / "demo_big.jsonl"
    demo_data(data, 2000 if args.tiny else 200_000)
    shape = None if args.tiny else {**SHAPES["1b"], "vocab_size": 104, "tie_word_embeddings": False}
    model = model_dir(work / "model-acc", shape)
    steps = 20 if args.tiny else ACCURACY_STEPS
    procs = {}
    against = args.against or f"fp8_{args.recipe}"
    for setting in ("bf16", against):
        extra = {"max_steps": steps, "max_length": 2048, "global_batch_size": 8, "learning_rate": 3e-4,
                 "lr_scheduler_type": "cosine", "warmup_steps": 20, "assistant_only_loss": False,
                 "dataloader_num_workers": 1}  # fmt: skip
        recipe = recipe_for(args, model, data, work / f"acc-{setting}", setting, "zero2", **extra)
        if args.tiny:
            recipe.update(max_length=256, global_batch_size=4, max_steps=steps)
        procs[setting] = launch(args, work, f"acc-{setting}", recipe)
    curves = {}
    for setting, proc in procs.items():
        rc = proc.wait(timeout=max(args.run_timeout * 3 - (time.time() - proc.started), 1))
        proc.log.close()
        metrics = work / f"acc-{setting}" / "metrics.jsonl"
        rows = [r for r in read_jsonl(metrics) if "loss" in r and "step" in r] if metrics.exists() else []
        curves[setting] = {"exit_code": rc, "steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows]}
    bf16, other = curves["bf16"]["loss"], curves[against]["loss"]
    tail = ACCURACY_TAIL if not args.tiny else 5
    result = {"curves": curves, "recipe": args.recipe, "against": against, "steps": steps, "tail": tail}
    if len(bf16) >= tail and len(other) >= tail:
        a, b = float(np.mean(bf16[-tail:])), float(np.mean(other[-tail:]))
        result.update(bf16_tail_mean=a, other_tail_mean=b, relative_difference=(b - a) / a)
        result["first_loss"] = {"bf16": bf16[0], against: other[0]}
        print(f"accuracy: last-{tail}-step mean loss bf16 {a:.5f}, {against} {b:.5f}, relative {(b - a) / a:+.4%}")
    name = "accuracy.json" if against.startswith("fp8") else f"accuracy_{against}.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")  # plotted by the report


def _against(result: dict) -> str:
    """What an accuracy result compared with bf16 (results before `--against`: FP8 with their recipe)."""
    return result.get("against") or f"FP8 ({result['recipe']})"


def plot_curves(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU machine has none: the report made here plots
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, curve in result["curves"].items():
        ax.plot(curve["steps"], curve["loss"], label=name, linewidth=1)
    if "relative_difference" in result:
        ax.set_title(f"bf16 vs {_against(result)}: last-{result['tail']}-step mean loss differs by "
                     f"{result['relative_difference']:+.3%}")  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def resume_part(args, work: Path) -> None:
    from benchmarks.common import llama_shape

    data = ROOT / "recipes" / "demo" / "data" / "train.jsonl"
    shape = llama_shape(256 if args.tiny else 2048, 4 if not args.tiny else 2, attention_dropout=0.1)
    model = model_dir(work / "model-resume", **shape)
    steps, save_every, kill_at = 12, 4, 8
    extra = {"max_steps": steps, "save_strategy": "steps", "save_steps": save_every, "max_length": 1024,
             "global_batch_size": 4, "learning_rate": 1e-3, "dataloader_num_workers": 2}  # fmt: skip
    setting = f"fp8_{args.recipe}"
    recipes = {name: recipe_for(args, model, data, work / f"resume-{name}", setting, "zero2", **extra)
               for name in ("reference_a", "reference_b", "resumed")}  # fmt: skip
    kill = {"SFT_TEST_KILL_DURING_SAVE": str(kill_at)}
    runs = {
        name: launch(args, work, f"resume-{name}", recipe, kill if name == "resumed" else None)
        for name, recipe in recipes.items()
    }  # fmt: skip (the three side by side)
    codes = {}
    for name, proc in runs.items():
        codes[name if name != "resumed" else "killed"] = proc.wait()
        proc.log.close()
    rerun = launch(args, work, "resume-resumed", recipes["resumed"])  # the same command again: it resumes
    codes["resumed"] = rerun.wait()
    rerun.log.close()
    what = f"FP8 ({args.recipe}) {steps} steps uninterrupted vs killed writing checkpoint-{kill_at} and rerun"
    result = {"what": what, "exit_codes": codes, "model": shape}
    try:
        result["run_to_run"] = compare(work / "resume-reference_a", work / "resume-reference_b")
        result["resume_vs_uninterrupted"] = compare(work / "resume-reference_a", work / "resume-resumed")
    except (AssertionError, OSError, KeyError) as e:
        result["error"] = repr(e)
    (args.out / "resume.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def plan_rows(runs: dict) -> list[str]:
    from sft.model import shapes
    from sft.plan import memory as plan

    rows = ["| run | micro batch | plan GiB | measured GiB | error |", "| --- | --- | --- | --- | --- |"]
    work = Path(tempfile.mkdtemp())
    for name, r in runs.items():
        if "peak_memory_gib" not in r or r["model"] not in SHAPES:
            continue
        auto = next((x for x in r["plan"] if x.startswith("auto settings")), "")
        micro = int(auto.split("per_device_train_batch_size = ")[1].split(",")[0])
        config = work / f"{r['model']}.json"
        config.write_text(json.dumps(SHAPES[r["model"]]))
        setting = plan.Setting(gpus=r.get("gpus", 1), zero_stage=int(r["stage"][-1]), micro_batch=micro, seq_len=4096,
                               liger=True,
                               fp8=SETTINGS[r["setting"]]["fp8"])  # fmt: skip
        peak = plan.estimate(shapes.load_shape(str(config)), setting).peak / plan.GiB
        error = (r["peak_memory_gib"] - peak) / peak
        rows.append(f"| {name} | {micro} | {peak:.1f} | {r['peak_memory_gib']:.1f} | {error:+.1%} |")
    return rows


def report(args, dirs: list[Path]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for d in dirs:
        if (d / "runs.jsonl").exists():
            for line in (d / "runs.jsonl").read_text().splitlines():
                runs[json.loads(line)["name"]] = json.loads(line)
    env_files = [d / "environment.json" for d in dirs if (d / "environment.json").exists()]
    envs = [json.loads(f.read_text()) for f in env_files] or [environment()]
    env = envs[0]
    devices = ", ".join(dict.fromkeys(e["device"] for e in envs))  # the calls' machines (a run's name says its GPUs)
    lines = [f"# FP8 (torchao float8) vs bf16 — {devices}", "",
             f"Date {env['date']}; seq 4096; global batch {throughput.GLOBAL_BATCH} packed rows; random-init Llama "
             "shapes; MFU against 989 TFLOP/s dense bf16 (spec) in every row, FP8 included. Versions: "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items()), "",
             "| run | exit | tokens/s/GPU | vs bf16 | MFU (bf16 peak) | peak GiB | auto settings (plan) |",
             "|" + " --- |" * 7]  # fmt: skip
    ratios = {}
    for name, r in runs.items():
        if "tokens_per_second_per_gpu" not in r:
            tail = r.get("log_tail", "")
            why = next((w for key, w in FAILURES.items() if key in tail), "see logs.tar.gz")
            lines.append(f"| {name} | {r['exit_code']} | failed: {why} | | | | |")
            continue
        base = runs.get(name.rsplit("-", 1)[0] + "-bf16", {})
        ratio = None
        if "tokens_per_second_per_gpu" in base:
            ratio = r["tokens_per_second_per_gpu"] / base["tokens_per_second_per_gpu"]
        if ratio is not None and r["setting"] != "bf16":
            ratios[name] = ratio
        chosen = next((p.removeprefix("auto settings: ") for p in r["plan"] if p.startswith("auto settings")), "-")
        lines.append(
            f"| {name} | 0 | {r['tokens_per_second_per_gpu']:.0f} | {f'{ratio:.3f}x' if ratio else '-'} | "
            f"{100 * (r['mfu'] or 0):.1f}% | {r['peak_memory_gib']:.1f} | {chosen} |"
        )
    lines += ["", "## Memory plan vs measured peak", "",
              "`sft.plan.memory` for each run's setting (stage, GPUs, the plan's micro batch, Liger, FP8 as run) "
              "against `max_memory_allocated`:", ""] + plan_rows(runs)  # fmt: skip
    for d in dirs:
        for path in [*d.glob("accuracy*.json"), d / "resume.json"]:
            if path.exists() and path.parent != args.out:
                (args.out / path.name).write_text(path.read_text())
    for path in sorted(args.out.glob("accuracy*.json")):
        acc = json.loads(path.read_text())
        plot = path.with_suffix(".png").name
        if "relative_difference" in acc:
            other = acc.get("other_tail_mean", acc.get("fp8_tail_mean"))  # fp8_: results before `--against`
            lines += ["", f"## Accuracy: bf16 against {_against(acc)} ({acc['steps']} steps, `{plot}`)", "",
                      f"Last-{acc['tail']}-step mean loss: bf16 {acc['bf16_tail_mean']:.5f}, {_against(acc)} "
                      f"{other:.5f}: relative {acc['relative_difference']:+.3%}."]  # fmt: skip
        plot_curves(acc, args.out / plot)
    if (args.out / "resume.json").exists():
        res = json.loads((args.out / "resume.json").read_text())
        lines += ["", "## Resume with FP8", "", f"{res['what']}; exit codes {res['exit_codes']}", ""]
        for pair in ("run_to_run", "resume_vs_uninterrupted"):
            if pair in res:
                lines.append(f"- {pair}: " + ", ".join(f"{k} {v}" for k, v in res[pair].items()))
    write_results(args.out, "fp8", {"environment": env, "runs": runs, "ratios": ratios}, "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="throughput", help="Comma-separated: throughput, zero3, accuracy, resume")
    parser.add_argument("--report", nargs="*", type=Path, help="Merge the results of these output dirs; run nothing")
    parser.add_argument("--recipe", default="tensorwise", choices=["rowwise", "tensorwise"], help="accuracy/resume")
    parser.add_argument("--against", choices=sorted(SETTINGS), help="accuracy: the setting against bf16 (default: "
                        "FP8 with --recipe; adam8: torchao's 8-bit AdamW)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="Logged steps left out of the averages")
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--run-timeout", type=float, default=200, help="Seconds before a run is killed")
    parser.add_argument("--budget", type=float, default=1e9, help="Seconds after which no new speed run starts")
    parser.add_argument("--tiny", action="store_true", help="Demo-sized models on CPU (with SFT_FP8_ON_CPU=1)")
    args = parser.parse_args()
    args.t0 = time.time()
    if args.report:
        report(args, args.report)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    args.gpu = env["gpu"]
    (args.out / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
    work = Path(tempfile.mkdtemp(prefix="fp8-"))
    (work / "logs").mkdir(parents=True)
    try:
        for part in args.parts.split(","):
            print(f"== {part}", flush=True)
            if part in PARTS:
                speed_part(args, work, part)
            elif part == "accuracy":
                accuracy_part(args, work)
            elif part == "resume":
                resume_part(args, work)
            else:
                raise SystemExit(f"unknown part {part!r}")
    finally:
        shutil.make_archive(str(args.out / "logs"), "gztar", work, "logs")
    report(args, [args.out])


if __name__ == "__main__":
    main()
