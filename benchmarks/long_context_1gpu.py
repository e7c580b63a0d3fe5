"""Long context on one GPU: the plan's longest row trained, sft against TRL's long-context recipe, exactness at length.

    python -m benchmarks.long_context_1gpu --parts speed --out $OUT
    python -m benchmarks.long_context_1gpu --parts longest --longest llama-8b:0 --out $OUT
    python -m benchmarks.long_context_1gpu --parts exact --out $OUT
    python -m benchmarks.long_context_1gpu --parts rows --longest llama-3b:12 --factors 1.0,1.1 --out $OUT

Every sft run is the real CLI (`sft/train.py`, one process) on a random-weight shape (bf16, one sample of L random
token ids per row, global batch 1 row), `ds_configs/zero3.json` or `zero2.json` with every memory lever `auto`
(activation checkpointing, its offload, the tiled MLP, ZeRO's optimizer and weight offload: `sft.plan.memory` decides).

- `longest`: for each `shape:cap` of `--longest` (cap: GiB the GPU is capped at with `max_gpu_memory_gib`, 0: the
  whole GPU), the plan's longest row for this GPU and this machine's host memory (`sft.plan.fits.longest`, ZeRO-3),
  then sft trained at that length for `--steps` optimizer steps (3) and, with `--over` (1.1), at that factor of it with
  the plan check off. Peak GPU memory (allocated, the metrics' `peak_memory_gib`) and peak host memory (the
  machine's MemTotal - MemAvailable above its level before the run, sampled every 0.2 s) next to the plan's lines.
  The run is stopped once its last step is logged (the final save of an 8B model is not what is measured).
- `rows`: the plan's setting for the longest row of each `shape:cap` (its levers given instead of `auto`, the plan
  check off, the GPU capped at `cap`) trained at `--factors` times that row: where the measured limit is (a factor
  that runs out of memory), peak GPU memory (allocated and reserved) and host memory against length.
- `speed`: the 1B shape at `--speed-lengths` (32k, 128k): sft's default (ZeRO-2 config, levers `auto`) against
  TRL's own long-context recipe in a plain script (`--trl-worker`, no sft code in the loop): SFTTrainer with
  gradient checkpointing, its fused (chunked) LM-head loss, Liger's kernels, sdpa attention (PyTorch's
  FlashAttention-2 kernel: one sample per row, causal), no DeepSpeed, 5 steps; tokens/s over the last 3 steps from
  step end times, MFU as sft's (the same FLOPs per token, causal attention counted) x the tokens/s ratio, peak memory.
- `exact`: the 1B shape at 131,072 tokens, 2 steps of the same sample: activation checkpointing alone (ZeRO-2)
  against every lever on (ZeRO-3, checkpoints offloaded, tiled MLP, optimizer and weights offloaded); loss and
  gradient norm per step.
Results: `long_context_1gpu.{json,md}` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from benchmarks.common import (
    LLAMA_SHAPES,
    ROOT,
    environment,
    model_dir,
    read_jsonl,
    sft_command,
    start,
    stop,
    write_results,
)
from benchmarks.long_context import fixed_length_data, on_gpus


def shape_config(name: str) -> dict:
    """A Llama shape of `benchmarks.common`, or `qwen3-4b` (sft's shipped Qwen3-4B config with the demo's ids)."""
    if name in LLAMA_SHAPES:
        return LLAMA_SHAPES[name]
    from sft.model.shapes import shipped_config

    config = shipped_config({"qwen3-4b": "Qwen/Qwen3-4B"}[name])
    return {**config, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 3, "dtype": "bfloat16"}


class HostPeak:
    """The machine's used memory (MemTotal - MemAvailable) sampled in a thread: its peak above the level at start."""

    def __init__(self):
        self.settle()
        self.base = self.peak = self.used()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def settle(self, seconds: float = 120) -> None:
        """Wait (up to `seconds`) until the machine's used memory stops falling: a run stopped just before still
        hands its host memory back for a while, and the base taken then made the next run's peak too low."""
        last, began = self.used(), time.time()
        while time.time() - began < seconds:
            time.sleep(2)
            now = self.used()
            if last - now < 2**29:
                return
            last = now

    @staticmethod
    def used() -> int:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024

    def sample(self):
        start, self.series = time.time(), []  # (seconds, GiB above the start) every 2 s
        while self.running:
            used = self.used()
            self.peak = max(self.peak, used)
            if not self.series or time.time() - start >= self.series[-1][0] + 2:
                self.series.append((round(time.time() - start, 1), round((used - self.base) / 2**30, 2)))
            time.sleep(0.2)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return (self.peak - self.base) / 2**30


def sft_run(
    work: Path,
    name: str,
    model: str,
    length: int,
    steps: int,
    extra: list[str],
    deepspeed: str,
    weights: bool = False,
) -> dict:
    """One sft run of `model` on rows of `length` tokens, stopped once `steps` steps are logged (or when it ends);
    `weights`: from a checkpoint of random weights (the same in every run) instead of sft's own initialisation."""
    import yaml

    from benchmarks.common import random_checkpoint

    config = {**shape_config(model), "max_position_embeddings": max(length, 8192)}
    path = random_checkpoint(work / f"{model}_weights", config) if weights else model_dir(work / model, config)
    data = fixed_length_data(work / f"fixed_{model}_{length}.jsonl", 4, length, config["vocab_size"])
    out = work / name
    recipe = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    recipe.pop("eval_datasets")
    recipe.update(
        model_name_or_path=str(path), from_scratch=not weights, datasets=[{"path": str(data)}], output_dir=str(out),
        bf16=True, dtype="bfloat16", eval_strategy="no", save_strategy="no", logging_steps=1, report_to="none",
        assistant_only_loss=False, learning_rate=1e-5, warmup_steps=0, max_length=length, global_batch_size=1,
        gradient_accumulation_steps=1, max_steps=steps, deepspeed=deepspeed, per_device_train_batch_size="auto",
        activation_checkpointing="auto",
    )  # fmt: skip
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    log = work / f"{name}.log"
    host = HostPeak()
    began = time.time()
    proc = start(sft_command(1, ["--config", str(work / f"{name}.yaml"), *extra]), log, env=on_gpus(1))
    metrics, records = out / "metrics.jsonl", []
    while proc.poll() is None:
        time.sleep(1)
        records = [r for r in read_jsonl(metrics) if "loss" in r] if metrics.exists() else []
        if len(records) >= steps:
            break
    trained = time.time() - began
    stopped = proc.poll() is None
    if stopped:
        stop(proc)
    proc.wait()
    proc.log.close()
    host_gib = host.stop()
    records = [r for r in read_jsonl(metrics) if "loss" in r] if metrics.exists() else []
    text = log.read_text()
    wanted = ("Memory plan", "auto ->", "auto settings")
    plan = [line.split("INFO sft.plan.preflight: ")[-1] for line in text.splitlines()
            if "sft.plan.preflight" in line and any(w in line for w in wanted)]  # fmt: skip
    table = text.split("Memory plan for", 1)[1].split("usable per GPU", 1)[0].splitlines()[1:] if plan else []
    tail = records[-3:]
    return {
        "name": name, "model": model, "tokens": length, "rc": None if stopped else proc.returncode,
        "stopped_after_last_step": stopped, "oom": "OutOfMemoryError" in text or "out of memory" in text,
        "seconds": round(trained, 1), "steps": len(records), "loss": [r["loss"] for r in records],
        "grad_norm": [r["grad_norm"] for r in records],
        "finite": len(records) >= steps and all(abs(r["grad_norm"]) < float("inf") for r in records),
        "tokens_per_second": sum(r["tokens_per_second_per_gpu"] for r in tail) / len(tail) if tail else None,
        "mfu": sum(r["mfu"] for r in tail) / len(tail) if tail else None,
        "peak_gpu_gib": max((r.get("peak_memory_gib", 0) for r in records), default=None),
        "peak_reserved_gib": max((r.get("peak_reserved_gib", 0) for r in records), default=None),
        "peak_host_gib": round(host_gib, 2), "host_series": host.series, "plan": plan,
        "plan_table": [line.strip() for line in table],
        "error": [line for line in text.splitlines() if "Error" in line or "error:" in line][-3:],
    }  # fmt: skip


def planned(work: Path, spec: str):
    """(shape name, cap GiB, the plan's longest row for `shape:cap` with ZeRO-3 on this machine, the result's plan
    figures)."""
    import torch

    from sft.model import architectures, shapes
    from sft.plan import fits as fitting
    from sft.plan import memory as plan

    model, cap = spec.split(":")
    cap = float(cap)
    config = shape_config(model)
    path = model_dir(work / model, config)
    shape = shapes.load_shape(str(path))
    gpu = cap * plan.GiB if cap else fitting.detected_gpu_memory()
    host = fitting.detected_host_memory()
    liger = architectures.of(shapes.load_config(str(path))).kernel("liger").on  # as sft's `auto` decides per family
    base = plan.Setting(gpus=1, zero_stage=3, liger=liger)
    top = fitting.longest(shape, base, gpu, host_memory=host)
    binds = fitting.binding(shape, top, gpu, 0.1, host)
    result = {
        "shape": model, "gpu_gib": gpu / plan.GiB, "host_gib": host / plan.GiB, "device": torch.cuda.get_device_name(),
        "planned_tokens": top.setting.seq_len, "planned_setting": top.setting.describe(),
        "planned_peak_gib": top.peak / plan.GiB, "planned_host_gib": top.host_pinned / plan.GiB, "binding": binds,
        "report": fitting.lever_report(top, base, gpu, 0.1, host, binds),
    }  # fmt: skip
    return model, cap, top, result


def longest(work: Path, spec: str, steps: int, over: float) -> dict:
    """The plan's longest row for `shape:cap` trained, and (with `over`) that many times it, with the same levers
    (the plan's for the longest row, given instead of `auto`) and the plan check off."""
    model, cap, top, result = planned(work, spec)
    extra = ["--max_gpu_memory_gib", str(cap)] if cap else []
    tag = f"{model}_{int(cap)}"
    zero3 = "ds_configs/zero3.json"
    result["at_plan"] = sft_run(work, f"longest_{tag}", model, top.setting.seq_len, steps, extra, zero3)
    if over:
        length = int(top.setting.seq_len * over) // 1024 * 1024
        levers, config = given_levers(work, top.setting, tag)
        result["over"] = sft_run(work, f"over_{tag}", model, length, steps, [*extra, *levers], config)
    return result


def given_levers(work: Path, s, tag: str) -> tuple[list[str], str]:
    """(CLI flags, a DeepSpeed config) that give the levers of the plan's setting `s` instead of `auto`, with the
    plan check off."""
    config = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {"device": "cpu" if s.offload_optimizer else "none", "pin_memory": True}
    if s.offload_optimizer and s.ratio < 1:
        zero["offload_optimizer"]["ratio"] = s.ratio
    zero["offload_param"] = {"device": "cpu" if s.offload_params else "none", "pin_memory": True}
    path = work / f"zero3_{tag}.json"
    path.write_text(json.dumps(config, indent=1))
    flags = {**s.tools._asdict(), "plan_check": False}
    for engine_lever in ("offload_optimizer", "offload_params"):  # the DeepSpeed config's, written above
        flags.pop(engine_lever)
    return [item for k, v in flags.items() for item in (f"--{k}", str(v).lower())], str(path)


def rows(work: Path, spec: str, factors: list[float], steps: int, into: list, save=lambda: None) -> None:
    """The plan's setting for its longest row of `shape:cap` (levers given, the plan check off, the GPU capped at
    `cap`) trained at each of `factors` times that row (2 steps above it): where the limit is, and peak GPU memory
    against length. Appended to `into` before the first run, `save()` after each."""
    model, cap, top, result = planned(work, spec)
    into.append(result)
    tag = f"{model}_{int(cap)}"
    levers, config = given_levers(work, top.setting, tag)
    extra = [*levers, "--max_gpu_memory_gib", str(cap)] if cap else levers
    result["runs"] = {}
    for factor in factors:
        length = int(top.setting.seq_len * factor) // 1024 * 1024
        at = steps if factor <= 1 else min(steps, 2)  # above the plan's row: whether it trains, not its speed
        result["runs"][str(length)] = sft_run(work, f"rows_{tag}_{length}", model, length, at, extra, config)
        save()


def trl_worker(args) -> None:
    """TRL's long-context recipe on one GPU: SFTTrainer, gradient checkpointing, its fused LM-head loss, Liger's
    kernels, sdpa; nothing of sft's."""
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

    config = SFTConfig(
        output_dir=str(args.work / "trl_out"), max_length=args.trl_length, packing=False,
        per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=5, learning_rate=1e-5, bf16=True,
        gradient_checkpointing=True, use_liger_kernel=True, logging_steps=1, save_strategy="no", report_to="none",
        dataset_num_proc=1,
    )  # fmt: skip
    path = model_dir(args.work / args.trl_model, shape_config(args.trl_model),
                     max_position_embeddings=max(args.trl_length, 8192))  # fmt: skip
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16,
                                             attn_implementation="sdpa").cuda()  # fmt: skip
    vocab = shape_config(args.trl_model)["vocab_size"]
    data = fixed_length_data(args.work / f"fixed_{args.trl_model}_{args.trl_length}.jsonl", 4, args.trl_length, vocab)
    trainer = SFTTrainer(model, config, train_dataset=datasets.load_dataset("json", data_files=str(data),
                         split="train"), processing_class=AutoTokenizer.from_pretrained(path),
                         callbacks=[StepTimes()])  # fmt: skip
    trainer.train()
    tail = times[-4:]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("TRL_RESULT " + json.dumps({"tokens_per_second": args.trl_length * (len(tail) - 1) / (tail[-1] - tail[0]),
          "loss": losses, "steps": len(times), "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}),
          flush=True)  # fmt: skip


def speed(work: Path, lengths: list[int], model: str = "llama-1b", save=lambda _: None) -> dict:
    import sys

    from benchmarks.common import run

    result = {}
    for length in lengths:
        ours = sft_run(work, f"speed_sft_{length}", model, length, 5, [], "ds_configs/zero2.json")
        log = work / f"speed_trl_{length}.log"
        args = ["-m", "benchmarks.long_context_1gpu", "--trl-worker", "--trl-length", str(length),
                "--trl-model", model, "--work", str(work)]  # fmt: skip
        rc, seconds = run([sys.executable, *args], log, env=on_gpus(1))
        lines = [line for line in log.read_text().splitlines() if line.startswith("TRL_RESULT ")]
        trl = {"rc": rc, "seconds": round(seconds, 1), **(json.loads(lines[-1][11:]) if lines else {})}
        side = {"sft": ours, "trl": trl}
        if ours["tokens_per_second"] and trl.get("tokens_per_second"):
            side["sft_over_trl"] = ours["tokens_per_second"] / trl["tokens_per_second"]
            side["trl_mfu"] = ours["mfu"] / side["sft_over_trl"]
        result[str(length)] = side
        save(result)
    return result


def keep(work: Path, length: int = 131072, model: str = "llama-1b") -> dict:
    """Kept attention outputs against full checkpointing at `length`, both without FP8 and compiled layers (whose
    compiled layer runs inside the checkpoint, where the selection does not reach), 5 steps."""
    plain = ["--activation_checkpointing", "true", "--fp8", "false", "--compile_decoder_layers", "false"]
    return {
        name: sft_run(
            work,
            f"keep_{name}_{length}",
            model,
            length,
            5,
            [*plain, "--keep_attention_outputs", flag],
            "ds_configs/zero2.json",
        )  # fmt: skip
        for name, flag in (("kept", "true"), ("recomputed", "false"))
    }


def exact(work: Path, length: int = 131072, model: str = "llama-1b") -> dict:
    off = ["--fp8", "false", "--compile_decoder_layers", "false", "--keep_attention_outputs", "false"]
    alone = ["--activation_checkpointing", "true", "--offload_checkpoints", "false", "--tiled_mlp", "false", *off]
    levers = ["--activation_checkpointing", "true", "--offload_checkpoints", "true", "--tiled_mlp", "true", *off]
    ckpt = sft_run(work, "exact_ckpt", model, length, 2, alone, "ds_configs/zero2.json", weights=True)
    every = sft_run(work, "exact_every_lever", model, length, 2, levers, "ds_configs/zero3_offload.json", weights=True)
    result = {"checkpointing_only": ckpt, "every_lever": every}
    if ckpt["loss"] and len(ckpt["loss"]) == len(every["loss"]):
        result["loss_rel_diff"] = [abs(a - b) / abs(a) for a, b in zip(ckpt["loss"], every["loss"], strict=True)]
        result["grad_norm_rel_diff"] = [abs(a - b) / abs(a) for a, b in
                                        zip(ckpt["grad_norm"], every["grad_norm"], strict=True)]  # fmt: skip
    return result


def markdown(result: dict) -> str:
    lines = ["# Long context on one GPU", "", result["environment"]["device"], ""]
    if result.get("longest"):
        lines += ["## The plan's longest row, trained", "",
                  "| shape | GPU GiB | host GiB | planned tokens | binding | planned peak GPU / host GiB | trained "
                  "steps (finite) | measured peak GPU / host GiB | s/step | over x1.1: steps, OOM |",
                  "|---" * 10 + "|"]  # fmt: skip
        for r in result["longest"]:
            at, over = r["at_plan"], r.get("over") or {}
            per_step = f"{at['seconds'] / max(at['steps'], 1):.0f}"
            lines.append(
                f"| {r['shape']} | {r['gpu_gib']:.1f} | {r['host_gib']:.1f} | {r['planned_tokens']:,} | "
                f"{r['binding']} | {r['planned_peak_gib']:.2f} / {r['planned_host_gib']:.2f} | "
                f"{at['steps']} ({at['finite']}) | "
                f"{at['peak_gpu_gib']} / {at['peak_host_gib']} | {per_step} | "
                f"{over.get('tokens', '-')}: {over.get('steps', '-')}, {over.get('oom', '-')} |"
            )
        for r in result["longest"]:
            lines += ["", f"{r['shape']} ({r['gpu_gib']:.1f} GiB): {r['planned_setting']}; {r['report']}"]
        lines.append("")
    for r in result.get("rows", []):
        if not r.get("runs"):
            continue
        lines += [f"## {r['shape']}: the plan's setting for its longest row ({r['planned_tokens']:,} tokens, "
                  f"{r['gpu_gib']:.1f} GiB GPU) at other lengths", "", f"{r['planned_setting']}; {r['report']}", "",
                  "| tokens | steps (finite) | OOM | peak allocated GiB | peak reserved GiB | planned peak GiB | "
                  "host GiB | planned host GiB | s |", "|---" * 9 + "|"]  # fmt: skip
        for length, run in r["runs"].items():
            table = {line.rsplit(None, 2)[0]: line.split()[-2] for line in run["plan_table"] if "GiB" in line}
            planned_peak = next((v for k, v in table.items() if k.startswith("peak per GPU")), "-")
            planned_host = table.get("host memory held while training (per node)", "-")
            cells = [f"{int(length):,}", f"{run['steps']} ({run['finite']})", run["oom"], run["peak_gpu_gib"],
                     run.get("peak_reserved_gib"), planned_peak, run["peak_host_gib"], planned_host,
                     run["seconds"]]  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    if result.get("speed"):
        lines += ["## sft's default against TRL's long-context recipe, Llama-3.2-1B shape, one GPU", "",
                  "| tokens | sft tokens/s | sft MFU | sft peak GiB | TRL tokens/s | TRL MFU | TRL peak GiB "
                  "| sft / TRL |",
                  "|---" * 8 + "|"]  # fmt: skip
        for n, side in result["speed"].items():
            ours, trl = side["sft"], side["trl"]
            ratio = f"{side['sft_over_trl']:.2f}" if side.get("sft_over_trl") else "-"
            lines.append(f"| {int(n):,} | {ours['tokens_per_second'] or 0:.0f} | {ours['mfu'] or 0:.3f} | "
                         f"{ours['peak_gpu_gib']} | {trl.get('tokens_per_second', 0):.0f} | "
                         f"{side.get('trl_mfu') or 0:.3f} | {trl.get('peak_gpu_gib', 0):.1f} | {ratio} |")  # fmt: skip
        for n, side in result["speed"].items():
            lines += ["", f"sft at {n}: " + "; ".join(side["sft"]["plan"])]
        lines.append("")
    if result.get("keep"):
        lines += ["## Attention outputs kept vs recomputed, 1B shape, 131,072 tokens, bf16, layers not compiled", "",
                  "| run | tokens/s | MFU | peak GiB |", "|---|---|---|---|"]  # fmt: skip
        for name, r in result["keep"].items():
            lines.append(f"| {name} | {r['tokens_per_second'] or 0:.0f} | {r['mfu'] or 0:.3f} | {r['peak_gpu_gib']} |")
        lines.append("")
    if result.get("exact"):
        e = result["exact"]
        lines += ["## Exactness at 131,072 tokens, Llama-3.2-1B shape: checkpointing alone vs every lever", ""]
        for key in ("checkpointing_only", "every_lever"):
            lines.append(f"- {key}: loss {e[key]['loss']}, grad norm {e[key]['grad_norm']}, peak GPU "
                         f"{e[key]['peak_gpu_gib']} GiB, host {e[key]['peak_host_gib']} GiB")  # fmt: skip
        lines += [f"- loss relative difference per step: {e.get('loss_rel_diff')}",
                  f"- gradient norm relative difference per step: {e.get('grad_norm_rel_diff')}", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parts", default="speed,exact,longest")
    parser.add_argument("--work", type=Path, default=Path("/tmp/long_context_1gpu"))
    parser.add_argument("--longest", default="llama-8b:0", help="shape:cap_gib,... (cap 0: the whole GPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--over", type=float, default=0.0, help="also train at this factor of the longest row")
    parser.add_argument("--speed-lengths", default="32768,131072")
    parser.add_argument("--factors", default="1.0,1.1", help="rows: lengths as factors of the plan's longest row")
    parser.add_argument("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF for the sft runs")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trl-model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    if args.trl_worker:
        trl_worker(args)
        return
    result = {"environment": environment()}
    for part in args.parts.split(","):
        if part == "speed":
            lengths = [int(n) for n in args.speed_lengths.split(",")]
            result["speed"] = speed(args.work, lengths, save=lambda r: write_results(
                args.out, "long_context_1gpu", {**result, "speed": r}, markdown({**result, "speed": r})))  # fmt: skip
        elif part == "keep":
            result["keep"] = keep(args.work)
        elif part == "exact":
            result["exact"] = exact(args.work)
        elif part == "rows":
            result["rows"] = []
            factors = [float(f) for f in args.factors.split(",")]
            save = lambda: write_results(args.out, "long_context_1gpu", result, markdown(result))  # noqa: E731
            for spec in args.longest.split(","):
                rows(args.work, spec, factors, args.steps, result["rows"], save)
        elif part == "longest":
            result["longest"] = []
            for spec in args.longest.split(","):
                result["longest"].append(longest(args.work, spec, args.steps, args.over))
                write_results(args.out, "long_context_1gpu", result, markdown(result))
        write_results(args.out, "long_context_1gpu", result, markdown(result))


if __name__ == "__main__":
    main()
