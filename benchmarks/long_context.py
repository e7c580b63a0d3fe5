"""Long-context SFT with sequence parallelism (Ulysses) on 2 GPUs: exactness, the longest row, throughput.

    python -m benchmarks.long_context --out $OUT                      # every part
    python -m benchmarks.long_context --parts equality --out $OUT

Every run is the real CLI (`sft/train.py` under torchrun) on random-weight Llama shapes (bf16 mixed precision, the
demo tokenizer's ids, no dropout), padding-free packing on `sft_varlen`, Liger when installed, `--trace_data`.

- `equality`: the Llama-3.2-1B shape on rows of 16,384 tokens packed from SFT-like samples (many samples per row,
  some straddling the split between the two sp ranks), global batch 2 rows, ZeRO-2, 4 steps: sp=1 on 1 GPU against
  sp=2 on 2 GPUs; per-step loss and grad norm, samples per step, tokens.
- `limit`: the Llama-3.1-8B shape, ZeRO-3, sp=2 on 2 GPUs, one sample of L tokens per row, `auto` micro batch and
  activation checkpointing (the plan decides), `--limit-steps` steps (2), for each L of `--limit-lengths`: whether it
  trains, the measured peak memory and the planner's figure for the same setting.
- `throughput`: the 8B shape, ZeRO-3, sp=2, rows of 32k and 64k tokens (one sample each), 5 steps: tokens/s per GPU
  and MFU (dense bf16 spec peak) of the last 3.
- `trl`: TRL's own sequence-parallel path side by side with sft at `--trl-lengths` (default 32k): a plain script
  (`--trl-worker`, no sft code in the loop) with TRL's SFTTrainer and `parallelism_config` (accelerate's
  ParallelismConfig, sp_backend deepspeed, sp 2; DeepSpeed's process group started before the model is built, which
  ZeRO-3's zero.Init needs), the same model shape, data (one sample per row), ZeRO-3 config,
  activation checkpointing and Liger as sft's run; sdpa attention (flash-attn has no wheel here, and with one sample
  per row sdpa's causal flash kernel keeps samples apart), 5 steps; tokens/s per GPU from its step times over the
  last 3, MFU as sft's x the tokens/s ratio (the same FLOPs per token).
Results: `long_context.{json,md}` (and the logs) under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import (
    LLAMA_SHAPES,
    ROOT,
    environment,
    model_dir,
    read_jsonl,
    run,
    sft_command,
    torchrun,
    write_results,
)
from sft.run.metrics import samples_per_step


def on_gpus(n: int) -> dict:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n)), "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}"}


def fixed_length_data(path: Path, n: int, length: int, vocab: int) -> Path:
    """`n` records of exactly `length` random token ids: one sample per packed row."""
    import numpy as np

    if not path.exists():
        rng = np.random.default_rng(0)
        with open(path, "w") as f:
            for _ in range(n):
                f.write(json.dumps({"input_ids": rng.integers(10, vocab, size=length).tolist()}) + "\n")
    return path


def sft_like_data(path: Path, n: int, vocab: int) -> Path:
    from benchmarks.common import make_sft_data

    if not path.exists():
        make_sft_data(path, n, vocab, 8192)
    return path


def train(work: Path, name: str, nproc: int, model: Path, data: Path, extra: list[str], profile: int = 0) -> dict:
    """One run of the CLI; with `profile`, optimizer step `profile` runs under torch.profiler
    (`benchmarks.profile_step`) and its kernel-class summary is returned."""
    import yaml

    out = work / name
    recipe = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    recipe.pop("eval_datasets")
    recipe.update(
        model_name_or_path=str(model), from_scratch=True, datasets=[{"path": str(data)}], output_dir=str(out),
        bf16=True, dtype="bfloat16", eval_strategy="no", save_strategy="no", logging_steps=1, report_to="none",
        assistant_only_loss=False, trace_data=True, learning_rate=1e-5, warmup_steps=0,
    )  # fmt: skip
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    args = ["--config", str(work / f"{name}.yaml"), *extra]
    start = time.time()
    trace = work / f"{name}.profile.json"
    if profile:
        command = [*torchrun(nproc), "-m", "benchmarks.profile_step", "--inner", str(work / f"{name}.yaml"),
                   "--profile-step", str(profile), "--out", str(trace), *extra]  # fmt: skip
    else:
        command = sft_command(nproc, args)
    rc, _ = run(command, work / f"{name}.log", env=on_gpus(nproc))
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] if (out / "metrics.jsonl").exists() else []
    log = (work / f"{name}.log").read_text()
    return {"name": name, "rc": rc, "seconds": round(time.time() - start, 1), "records": records, "out": str(out),
            "oom": "OutOfMemoryError" in log or "CUDA out of memory" in log,
            "profile": json.loads(trace.read_text()) if profile and trace.exists() else None,
            "plan": [line.split("INFO sft.plan.preflight: ")[-1] for line in log.splitlines() if "Memory plan" in line
                     or "peak per GPU" in line or "fits" in line][:3]}  # fmt: skip


def equality(work: Path, extra: list[str]) -> dict:
    model = model_dir(work / "llama-1b", LLAMA_SHAPES["llama-1b"])
    data = sft_like_data(work / "sft_like.jsonl", 4000, LLAMA_SHAPES["llama-1b"]["vocab_size"])
    common = ["--max_length", "16384", "--per_device_train_batch_size", "1", "--global_batch_size", "2",
              "--gradient_accumulation_steps", "1", "--max_steps", "4",
              "--deepspeed", "ds_configs/zero2.json", *extra]  # fmt: skip
    sp1 = train(work, "equality_sp1", 1, model, data, common)
    sp2 = train(work, "equality_sp2", 2, model, data, [*common, "--sequence_parallel_size", "2"])
    result = {"sp1": summary(sp1), "sp2": summary(sp2)}
    if sp1["records"] and sp2["records"]:
        for key in ("loss", "grad_norm"):
            result[f"{key}_max_rel_diff"] = max(
                abs(a[key] - b[key]) / abs(a[key]) for a, b in zip(sp1["records"], sp2["records"], strict=False)
            )
        result["num_tokens_equal"] = [r["num_tokens"] for r in sp1["records"]] == [
            r["num_tokens"] for r in sp2["records"]
        ]
        result["samples_equal_every_step"] = samples_per_step(sp1["out"]) == samples_per_step(sp2["out"])
    return result


def summary(run_: dict) -> dict:
    records = run_["records"]
    tail = records[-3:]
    mean = lambda key: sum(r.get(key, 0) for r in tail) / len(tail) if tail else None  # noqa: E731
    return {
        "rc": run_["rc"], "oom": run_["oom"], "seconds": run_["seconds"], "steps": len(records),
        "loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
        "tokens_per_second_per_gpu": mean("tokens_per_second_per_gpu"), "mfu": mean("mfu"),
        "peak_memory_gib": max((r.get("peak_memory_gib", 0) for r in records), default=None),
        "plan": run_["plan"], **({"profile": run_["profile"]} if run_.get("profile") else {}),
    }  # fmt: skip


def long_rows(
    work: Path,
    name: str,
    length: int,
    steps: int,
    model: str = "llama-8b",
    gpus: int = 2,
    zero: int = 3,
    profile: int = 0,
    more: tuple = (),
) -> dict:
    """`model`'s shape on `gpus` GPUs (sp = gpus), one sample of `length` tokens per row, global batch 1 row, the
    micro batch and the memory tools `auto` (the plan's) unless `more` sets them."""
    shape = LLAMA_SHAPES[model]
    path = model_dir(work / model, shape, max_position_embeddings=max(length, 8192))
    data = fixed_length_data(work / f"fixed_{length}.jsonl", 8, length, shape["vocab_size"])
    extra = ["--max_length", str(length), "--global_batch_size", "1", "--gradient_accumulation_steps", "1",
             "--max_steps", str(steps), "--deepspeed", f"ds_configs/zero{zero}.json",
             "--sequence_parallel_size", str(gpus), "--per_device_train_batch_size", "auto",
             "--activation_checkpointing", "auto", *more]  # fmt: skip
    return summary(train(work, name, gpus, path, data, extra, profile))


def eight_b(work: Path, name: str, length: int, steps: int, profile: int = 0, more: tuple = ()) -> dict:
    return long_rows(work, name, length, steps, profile=profile, more=more)


def tools(work: Path, length: int) -> dict:
    """The memory tools' cost: the 1B shape on 1 GPU (ZeRO-2), rows of `length` tokens, each level of the plan's
    ladder with checkpointing forced on, 5 steps."""
    from sft.plan.memory import MEMORY_LEVELS

    result = {}
    for level in MEMORY_LEVELS[1:]:
        flags = ("--activation_checkpointing", "--offload_checkpoints", "--tiled_mlp")
        more = tuple(x for flag, on in zip(flags, level, strict=True) for x in (flag, str(on).lower()))
        name = "tools_" + "_".join(k for k, on in zip(("ckpt", "offload", "tiled"), level, strict=True) if on)
        result[name] = long_rows(work, name, length, 5, model="llama-1b", gpus=1, zero=2, more=more)
    return result


def trl_worker(args) -> None:
    """TRL's own SP path (run under torchrun with 2 processes): SFTTrainer + parallelism_config, nothing of sft's."""
    import datasets
    import deepspeed
    import torch
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    callbacks = [StepTimes()]
    if args.profile_step:
        from benchmarks.profile_step import step_profiler

        callbacks.append(step_profiler(args.profile_step, args.work / f"trl_{args.trl_length}.profile.json"))
    config = SFTConfig(
        output_dir=str(args.work / "trl_out"), max_length=args.trl_length, packing=False, padding_free=False,
        per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=5, learning_rate=1e-5,
        bf16=True, gradient_checkpointing=True, use_liger_kernel=True, logging_steps=1, save_strategy="no",
        report_to="none", deepspeed=str(ROOT / "ds_configs" / "zero3.json"), dataset_num_proc=1,
        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2, dp_replicate_size=1,
                                             sp_handler=handler),
    )  # fmt: skip
    model_path = args.work / "llama-8b"
    # DeepSpeed's process group before the model is built inside zero.Init, as sft does (without it DeepSpeed's batch
    # check counts one process: "train_batch_size is not equal to ... 2 != 1 * 1 * 1")
    deepspeed.init_distributed()
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(model_path), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    data = datasets.load_dataset("json", data_files=str(fixed_length_data(
        args.work / f"fixed_{args.trl_length}.jsonl", 8, args.trl_length, LLAMA_SHAPES["llama-8b"]["vocab_size"])),
        split="train")  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = SFTTrainer(model, config, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    trainer.train()
    if torch.distributed.get_rank() == 0:
        tail = times[-4:]  # the last 3 steps
        tps = args.trl_length * (len(tail) - 1) / (tail[-1] - tail[0]) / 2
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print("TRL_RESULT " + json.dumps({"tokens_per_second_per_gpu": tps, "loss": losses, "steps": len(times),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)  # fmt: skip


def trl_side_by_side(work: Path, length: int, profile: int = 0) -> dict:
    ours = eight_b(work, f"sft_{length}", length, 5, profile)
    args = ["-m", "benchmarks.long_context", "--trl-worker", "--trl-length", str(length), "--work", str(work)]
    args += ["--profile-step", str(profile)] if profile else []
    log = work / f"trl_{length}.log"
    rc, seconds = run([*torchrun(2), *args], log, env=on_gpus(2))
    lines = [line for line in log.read_text().splitlines() if line.startswith("TRL_RESULT ")]
    trl = {"rc": rc, "seconds": round(seconds, 1), **(json.loads(lines[-1][11:]) if lines else {})}
    trace = work / f"trl_{length}.profile.json"
    if profile and trace.exists():
        trl["profile"] = json.loads(trace.read_text())
    result = {"sft": ours, "trl": trl}
    if ours["tokens_per_second_per_gpu"] and trl.get("tokens_per_second_per_gpu"):
        result["sft_over_trl"] = ours["tokens_per_second_per_gpu"] / trl["tokens_per_second_per_gpu"]
        result["trl_mfu"] = ours["mfu"] / result["sft_over_trl"] if ours["mfu"] else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the results go (required but for the worker)")
    parser.add_argument("--parts", default="equality,throughput,limit")
    parser.add_argument("--limit-lengths", default="131072,196608")
    parser.add_argument("--work", type=Path, default=Path("/tmp/long_context"))
    parser.add_argument("--no-liger", action="store_true", help="equality part with Liger's kernels off")
    parser.add_argument("--trl-lengths", default="32768")
    parser.add_argument("--limit-steps", type=int, default=2)
    parser.add_argument("--tools-length", type=int, default=65536)
    parser.add_argument("--limit1-lengths", default="6144,10240")
    parser.add_argument("--profile-step", type=int, default=0, help="trl part: profile this step of both runs")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-length", type=int, default=32768, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    if args.out is None:
        parser.error("the following arguments are required: --out")
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment()}
    parts = args.parts.split(",")
    if "equality" in parts:
        result["equality"] = equality(args.work, ["--use_liger_kernel", "false"] if args.no_liger else [])
        dump(args, result)
    if "throughput" in parts:
        result["throughput"] = {str(n): eight_b(args.work, f"throughput_{n}", n, 5) for n in (32768, 65536)}
        dump(args, result)
    if "trl" in parts:
        lengths = args.trl_lengths.split(",")
        result["trl"] = {n: trl_side_by_side(args.work, int(n), args.profile_step) for n in lengths}
        dump(args, result)
    if "tools" in parts:
        result["tools"] = tools(args.work, args.tools_length)
        dump(args, result)
    if "limit1" in parts:  # the 8B shape on one GPU: the plan's longest row, and past it with the plan check off
        result["limit1"] = {}
        for n in (int(x) for x in args.limit1_lengths.split(",")):
            more = ("--plan_check", "false")
            result["limit1"][str(n)] = long_rows(args.work, f"limit1_{n}", n, args.limit_steps, gpus=1, more=more)
            dump(args, result)
    if "limit" in parts:
        result["limit"] = {}
        for n in (int(x) for x in args.limit_lengths.split(",")):
            result["limit"][str(n)] = eight_b(args.work, f"limit_{n}", n, args.limit_steps)
            dump(args, result)
    dump(args, result)


def dump(args, result: dict) -> None:
    lines = ["# Long-context SFT with sequence parallelism", "", f"{result['environment']['device']}", ""]
    eq = result.get("equality")
    if eq:
        lines += ["## sp=2 (2 GPUs) vs sp=1 (1 GPU), Llama-3.2-1B shape, 16k-token packed rows, bf16, ZeRO-2", ""]
        lines += [f"- {k}: {v}" for k, v in eq.items() if not isinstance(v, dict)]
        for k in ("sp1", "sp2"):
            lines.append(f"- {k}: {json.dumps(eq[k])}")
        lines.append("")
    for n, side in (result.get("trl") or {}).items():
        trl, ours = side["trl"], side["sft"]
        lines += [f"## sft vs TRL's own SP path, 8B shape, ZeRO-3, sp=2, {n} tokens per row (one sample)", ""]
        lines.append(f"- sft: {ours['tokens_per_second_per_gpu']} tokens/s/GPU, MFU {ours['mfu']}, peak "
                     f"{ours['peak_memory_gib']} GiB, rc {ours['rc']}")  # fmt: skip
        tps, peak = trl.get("tokens_per_second_per_gpu"), trl.get("peak_memory_gib")
        mfu = side.get("trl_mfu")
        lines.append(f"- TRL: {tps} tokens/s/GPU, MFU {mfu}, peak {peak} GiB (allocated), rc {trl['rc']}")
        lines += [f"- sft / TRL: {side.get('sft_over_trl')}", ""]
        profiles = {who: run_["profile"] for who, run_ in (("sft", ours), ("TRL", trl)) if run_.get("profile")}
        if profiles:
            classes = sorted({c for p in profiles.values() for c in p["by_class_s"]})
            lines += ["One profiled step (rank 0; kernel seconds by class):", "",
                      "| run | step wall s | GPU busy s | " + " | ".join(classes) + " |",
                      "|---" * (3 + len(classes)) + "|"]  # fmt: skip
            for who, p in profiles.items():
                cells = [who, f"{p['step_wall_s']:.3f}", f"{p['gpu_busy_s']:.3f}"]
                cells += [f"{p['by_class_s'].get(c, 0.0):.3f}" for c in classes]
                lines.append("| " + " | ".join(cells) + " |")
            for who, p in profiles.items():
                lines += ["", f"{who}: top kernels (s)", ""]
                lines += [f"- {v:.4f} {k[:140]}" for k, v in p["top_kernels_s"][:15]]
                lines += ["", f"{who}: top host ops by self CPU time (s)", ""]
                lines += [f"- {v:.4f} {k[:140]}" for k, v in p["top_cpu_self_s"][:12]]
            lines.append("")
    titles = {
        "throughput": "Llama-3.1-8B shape, ZeRO-3, sp=2 on 2 GPUs",
        "limit": "Llama-3.1-8B shape, ZeRO-3, sp=2 on 2 GPUs",
        "limit1": "Llama-3.1-8B shape, ZeRO-3, 1 GPU (plan check off past the plan's longest row)",
        "tools": f"memory tools, Llama-3.2-1B shape, ZeRO-2, 1 GPU, rows of {args.tools_length} tokens",
    }
    for part, title in titles.items():
        if result.get(part):
            header = "| run | rc | OOM | steps | tokens/s/GPU | MFU | peak GiB | planned GiB | s |"
            lines += [f"## {part}: {title}", "", header, "|---" * 9 + "|"]
            for n, s in result[part].items():
                tps = f"{s['tokens_per_second_per_gpu']:.0f}" if s["tokens_per_second_per_gpu"] else "-"
                mfu = f"{s['mfu']:.3f}" if s["mfu"] else "-"
                peak = f"{s['peak_memory_gib']:.1f}" if s["peak_memory_gib"] else "-"
                planned = next((line.split()[-2] for line in s["plan"] if "peak per GPU" in line), "-")
                cells = (n, s["rc"], s["oom"], s["steps"], tps, mfu, peak, planned, s["seconds"])
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
            lines.append("")
    write_results(args.out, "long_context", result, "\n".join(lines))


if __name__ == "__main__":
    main()
