"""The speed model's sweep: the settings the memory plan finds fitting, each trained by the real CLI, beside the plan's
estimates; `--fit` turns the runs into the cards' constants in `sft/plan/speed_constants.json`.

    python -m benchmarks.speed_sweep --shape 3b --out $OUT/3b                  # 1 GPU, ZeRO-2
    python -m benchmarks.speed_sweep --shape 8b --gpus 2 --parallel 2 --out $OUT/8b \
        --only z3-default z2-default z3-m16-ckpt-bf16 z3-m2-none-bf16+prof   # 4 GPUs: two 2-GPU runs at a time
    python -m benchmarks.speed_sweep --fit benchmarks/results/speed_sweep_*/call*/runs.jsonl   # every card at once
    python -m benchmarks.speed_sweep --report benchmarks/results/speed_sweep_h100/*/runs.jsonl   # plan vs measured
    python -m benchmarks.speed_sweep --tiny --out /tmp/sweep                    # CPU smoke test, demo model

The candidates: `sft.plan.fits.ranked` over micro batches (those dividing the global batch of 32 rows) and the
levers the speed model ranks (none, checkpointing, checkpointing that keeps attention outputs), with the kernels
`sft train` would use (Liger; FP8 and compiled layers as `auto` decides; attention outputs kept run eager in bf16),
plus the same without FP8 (the bf16 rows of the fit). Of each group (levers x kernels) the one the plan ranks fastest
and the smallest micro batch are run (the fit needs both ends), then sft's default (every lever `auto`): what the plan
chooses. `--only` names settings instead (`z<stage>-m<micro>-<none|ckpt|keep>-<bf16|bf16c|fp8>`, `z2-default`, with
`+variant`s: `VARIANTS`). Each run is `benchmarks/throughput.py`'s (same data, rows of 4,096 tokens, random weights),
`--steps` optimizer steps, the first `--warmup` left out, stopped once its last step is logged (`--keep-save` lets it
save). Per run: tokens/s/GPU, MFU, the step time, the peak memory, the allocator's retries, and the plan's estimates of
the same setting (peak GiB, tokens/s and its parts).

`--fit` solves for every card's constants at once (`Layout`) by least squares on the relative error of the median step
time (a step that compiled again is left out that way; constants non-negative): the efficiencies, the host's work per
layer and per gradient bucket (hidden while the GPU is busy), ZeRO's per-micro-step gradient work, the link, FP8's
casts; the half-efficiency tokens by a grid. It writes them with the runs they came from and prints each run's
estimate against its measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks.common import (
    LLAMA_SHAPES,
    ROOT,
    environment,
    free_gpus,
    make_sft_data,
    model_dir,
    read_jsonl,
    sft_command,
    start,
    stop,
    torchrun,
)
from benchmarks.throughput import COMMON, GLOBAL_BATCH, collect
from sft.core.batch import micro_batches_for
from sft.engines import bucket_elements
from sft.model import architectures
from sft.model.shapes import load_config, load_shape, shipped_config
from sft.plan import fits as fitting
from sft.plan import memory as plan
from sft.plan import speed

# other families at their public widths (the configs sft ships: `sft/model/model_configs.json`), for the per-family
# sweep of issue #65 (`--shape qwen3-4b`)
FAMILY_SHAPES = {"qwen3-4b": "Qwen/Qwen3-4B", "qwen3-8b": "Qwen/Qwen3-8B", "mistral-7b": "mistralai/Mistral-7B-v0.3",
                 "gemma2-9b": "google/gemma-2-9b", "qwen2.5-7b": "Qwen/Qwen2.5-7B",
                 "gemma3-4b": "google/gemma-3-4b", "olmo2-7b": "allenai/OLMo-2-1124-7B",
                 "phi3-mini": "microsoft/Phi-3-mini-4k-instruct"}  # fmt: skip
SHAPES = {
    "1b": LLAMA_SHAPES["llama-1b"],
    "3b": LLAMA_SHAPES["llama-3b"],
    "8b": LLAMA_SHAPES["llama-8b"],
    **{name: shipped_config(model) for name, model in FAMILY_SHAPES.items()},
    "tiny": None,
}  # tiny: the demo model (--tiny)
FAST_LEVELS = tuple(t for t in plan.ACTIVATION_LEVELS if t.ranked)  # none, attention kept, checkpointing


def setting_name(s: plan.Setting) -> str:
    levers = "keep" if s.keep_attention_outputs else "ckpt" if s.activation_checkpointing else "none"
    kernel = "fp8" if s.fp8 else "bf16c" if s.compiled else "bf16"
    return f"z{s.zero_stage}-m{s.micro_batch}-{levers}-{kernel}"


def from_name(name: str, base: plan.Setting) -> plan.Setting:
    """The setting a name of `setting_name` stands for (a `+exp` suffix, the allocator's variant, left aside)."""
    stage, micro, levers, kernel = name.split("+")[0].split("-")
    setting = dataclasses.replace(base, zero_stage=int(stage[1:]), micro_batch=int(micro[1:]),
                                  fp8=kernel == "fp8", compiled=kernel in ("fp8", "bf16c"))  # fmt: skip
    setting = dataclasses.replace(setting, accumulation=fitting.accumulation_for(setting, GLOBAL_BATCH),
                                  moment_bytes=_moment_bytes(name))  # fmt: skip
    return setting.with_tools(plan.Tools(levers != "none", False, False, keep_attention_outputs=levers == "keep"))


def _moment_bytes(name: str) -> float:
    """Adam's moment bytes a run's variants ask for (`+adam8`: torchao's 8-bit AdamW)."""
    fields = [VARIANTS[part].get("fields", {}) for part in name.split("+")[1:]]
    return plan.moment_bytes_of(next((f["optim"] for f in fields if "optim" in f), None))


# Variants of a setting (a `+name` suffix): `exp`, PyTorch's expandable segments (fewer allocator retries near the
# memory limit); `bkt`, ZeRO's gradient buckets of 5e8 elements instead of `auto` (hidden^2: hundreds of reductions
# per micro step); `z3b`, ZeRO-3's gradient and prefetch buckets both 5e8; `prof`, the last step under
# torch.profiler (benchmarks/profile_step.py's summary; that step left out of the timing); `adam8`, torchao's 8-bit
# AdamW (`optim: adamw_torch_8bit`: Adam's moments in 8-bit blocks, the plan counts them); `adamw`, torch's fused fp32
# AdamW as TRL's default (`optim: adamw_torch_fused`, not `auto`: a hand-tuned TRL run); `ds`, DeepSpeed as the config
# says (`engine: deepspeed`, not `auto`, which may take FSDP2 for a ZeRO-3 config); `nods`, no DeepSpeed (`deepspeed:
# none`: bf16 weights stepped by transformers' optimizer); `tao`, torchao's own 8-bit AdamW step instead of sft's fused
# kernel (`SFT_FUSED_ADAMW=0`, the baseline of sft.run.optimizer); `fsdp2`, the FSDP2 engine
# instead of DeepSpeed (`engine: fsdp2`; `z3-` names its fully sharded layout); `fsdp2g`, FSDP2 with the weights kept
# gathered from the forward to the backward (`fsdp_config: {reshard_after_forward: false}`)
VARIANTS = {"exp": {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
            "bkt": {"ds": {"reduce_bucket_size": 5e8}},
            "z3b": {"ds": {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e8}},
            "prof": {},
            "adam8": {"fields": {"optim": "adamw_torch_8bit"}},
            "adamw": {"fields": {"optim": "adamw_torch_fused"}},
            "ds": {"fields": {"engine": "deepspeed"}},
            "nods": {"fields": {"deepspeed": "none"}},
            "tao": {"env": {"SFT_FUSED_ADAMW": "0"}},
            "fsdp2": {"fields": {"engine": "fsdp2"}},
            "fsdp2g": {"fields": {"engine": "fsdp2", "fsdp_config": {"reshard_after_forward": False}}}}  # fmt: skip


def stage_of(name: str, default: int) -> int:
    """The ZeRO stage a run's name asks for (`z3-...`, `z2-default`), else `default`."""
    head = name.removeprefix("old-").split("-")[0]
    return int(head[1:]) if head[:1] == "z" and head[1:].isdigit() else default


def overrides(s: plan.Setting) -> dict:
    """The recipe fields that make `sft train` run setting `s` (nothing left to `auto`)."""
    return {"per_device_train_batch_size": s.micro_batch, "activation_checkpointing": s.activation_checkpointing,
            "keep_attention_outputs": s.keep_attention_outputs, "offload_checkpoints": False, "tiled_mlp": False,
            "fp8": s.fp8, "compile_decoder_layers": s.compiled, "use_liger_kernel": s.liger}  # fmt: skip


def base_setting(args, shape, arch, stage: int | None = None) -> plan.Setting:
    """The setting `sft train` starts from on this card (under ZeRO `stage`, default `--zero`): Liger, FP8 and
    compiled layers as `auto` decides."""
    stage = args.zero if stage is None else stage
    fp8_on = arch.kernel("fp8").on and stage != 3 and shape.hidden >= 2048 and not args.tiny
    compiled = (fp8_on and arch.kernel("compile").on) or (arch.kernel("compile_bf16").on and not args.tiny)
    return plan.Setting(gpus=args.gpus, zero_stage=stage, seq_len=args.seq_len, liger=not args.tiny,
                        fp8=fp8_on, compiled=compiled, dtype_bytes=4 if args.tiny else 2)  # fmt: skip


def candidates(args, shape, arch, memory: float) -> list[fitting.Ranked]:
    """Of each group (levers x kernels) that fits: the fastest by the plan and the smallest micro batch."""
    base = base_setting(args, shape, arch)
    dp = args.gpus
    micros = micro_batches_for(GLOBAL_BATCH, dp, plan.MICRO_BATCHES) or (1,)
    bases = [base] + ([dataclasses.replace(base, fp8=False, compiled=False)] if base.fp8 or base.compiled else [])
    chosen: dict[str, fitting.Ranked] = {}
    for b in bases:
        fits = fitting.ranked(shape, b, memory, args.headroom, micros, [b], FAST_LEVELS, target=GLOBAL_BATCH,
                           kernels=plan.Setting.attention_kept_eager)  # fmt: skip
        groups: dict[tuple, list[fitting.Ranked]] = {}
        for r in fits:
            s = r.estimate.setting
            groups.setdefault((s.tools, s.fp8, s.compiled), []).append(r)
        for group in groups.values():
            for r in (group[0], min(group, key=lambda r: r.estimate.setting.micro_batch)):
                chosen.setdefault(setting_name(r.estimate.setting), r)
    return sorted(chosen.values(), key=lambda r: -r.time.tokens_per_second)[: args.max_runs]


def sample_tokens(data: Path, max_length: int) -> float:
    """The length-weighted sample length of the data (sum(len^2) / sum(len), each capped at max_length): what a
    token's attention costs on average."""
    lengths = np.array([min(len(r["input_ids"]), max_length) for r in read_jsonl(data)], dtype=float)
    return float((lengths**2).sum() / lengths.sum())


def launch(name: str, recipe_fields: dict, args, work: Path, data: Path, model: Path, gpu_ids: list[int]):
    """Start run `name` (its recipe written to `work`) on the GPUs `gpu_ids`."""
    parts = [VARIANTS[part] for part in name.split("+")[1:]]
    variant = {k: v for part in parts for k, v in part.get("env", {}).items()}
    zero = {k: v for part in parts for k, v in part.get("ds", {}).items()}
    fields = {k: v for part in parts for k, v in part.get("fields", {}).items()}
    recipe = {**COMMON, "packing": True, "global_batch_size": GLOBAL_BATCH, **recipe_fields, **fields,
              "model_name_or_path": str(model), "max_length": args.seq_len}  # fmt: skip
    recipe.update(datasets=[{"path": str(data)}], output_dir=str(work / name), max_steps=args.steps)
    recipe["deepspeed"] = str(ROOT / "ds_configs" / f"zero{stage_of(name, args.zero)}.json")
    if fields.get("engine") == "fsdp2":  # FSDP2 shards instead of DeepSpeed
        recipe["deepspeed"] = None
    if fields.get("deepspeed") == "none":  # `+nods`: one replica per process, transformers' optimizer
        recipe["deepspeed"] = "none"
    if zero:
        config = json.loads(Path(recipe["deepspeed"]).read_text())
        config["zero_optimization"].update(zero)
        recipe["deepspeed"] = str(work / f"{name}-ds.json")
        Path(recipe["deepspeed"]).write_text(json.dumps(config))
    if args.gpu_memory:
        recipe["plan_gpu_memory_gib"] = args.gpu_memory
    if args.tiny:
        recipe.update(bf16=False, dtype="float32", attn_implementation="auto", peak_tflops=1.0)
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(recipe))
    env = {} if args.tiny else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))}
    env.update(variant)
    nproc = args.gpus if not args.tiny else 1
    if "+prof" in name:
        cmd = [*torchrun(nproc), "-m", "benchmarks.profile_step", "--inner", str(config),
               "--profile-step", str(args.steps), "--out", str(work / f"{name}.profile.json")]  # fmt: skip
    else:
        cmd = sft_command(nproc, ["--config", str(config)])
    return start(cmd, work / "logs" / f"{name}.log", env)


def _logged_steps(metrics: Path) -> int:
    return sum('"loss"' in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0


def wait_for_steps(proc, metrics: Path, steps: int, timeout: float):
    """How a run ended: its exit code, `"timeout"`, or `"stopped"` (killed once its `steps` steps were logged: the
    final save of an 8B model takes longer than its steps, and the sweep deletes the model anyway)."""
    while proc.poll() is None:
        if _logged_steps(metrics) >= steps:
            stop(proc)
            return "stopped"
        if time.time() - proc.started > timeout:
            stop(proc)
            return "timeout"
        time.sleep(1)
    return proc.returncode


def finish(name: str, proc, args, work: Path) -> dict:
    """The result of a run from `launch`, once it ended; its saved model deleted (GBs each), metrics kept."""
    metrics = work / name / "metrics.jsonl"
    rc = wait_for_steps(proc, metrics, args.steps, args.run_timeout) if args.stop_after_steps else None
    result = collect({"name": name}, proc, args, work, [name], rc=rc)
    steps = [r for r in read_jsonl(metrics) if "loss" in r] if metrics.exists() else []
    for path in (work / name).glob("*"):
        if path.name != "metrics.jsonl":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    profiled = work / f"{name}.profile.json"
    if profiled.exists():
        result["profile"] = json.loads(profiled.read_text())
        steps = steps[:-1]  # the profiled step runs slower
    timed = steps[args.warmup :]
    if timed and "tokens_per_second_per_gpu" in timed[0]:
        seconds = [r["tokens_per_step"] / args.gpus / r["tokens_per_second_per_gpu"] for r in timed]
        reserved = max((r.get("peak_reserved_gib", 0.0) for r in steps), default=0.0)
        result.update(step_seconds=float(np.mean(seconds)), step_seconds_each=seconds,
                      tokens_per_second_per_gpu=float(np.mean([r["tokens_per_second_per_gpu"] for r in timed])),
                      mfu=float(np.mean([r["mfu"] for r in timed])) if "mfu" in timed[0] else None,
                      alloc_retries=[r.get("alloc_retries") for r in steps], peak_reserved_gib=reserved)  # fmt: skip
    return result


def measure(args) -> None:
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="speed-sweep-"))
    (work / "logs").mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_dir(work / "model", SHAPES[args.shape])
    model_config = load_config(str(model))
    shape, arch = load_shape(str(model), False, model_config), architectures.of(model_config)
    memory = (args.gpu_memory * plan.GiB) if args.gpu_memory else fitting.detected_gpu_memory()
    data = work / "data.jsonl"
    make_sft_data(
        data, args.records, 104 if args.tiny else min(SHAPES[args.shape]["vocab_size"], 128_256), args.seq_len
    )
    span = sample_tokens(data, args.seq_len)
    env = environment()
    args.gpu = env["gpu"]
    card = speed.card(None if args.tiny else env["gpu"])
    if args.default_only:
        runs = []
    elif args.only:
        runs = []
        for name in args.only:
            if name.split("+")[0].endswith("default"):  # z2-default: sft's defaults under that stage
                runs.append((name, None))
                continue
            base = base_setting(args, shape, arch, stage_of(name, args.zero))
            s = from_name(name, base)
            runs.append((name, fitting.Ranked(plan.estimate(shape, s), speed.step_time(shape, s, card))))
    else:
        runs = [(setting_name(r.estimate.setting), r) for r in candidates(args, shape, arch, memory)]
    print(f"{len(runs)} runs: {', '.join(name for name, _ in runs)}", flush=True)
    todo = [(name, overrides(r.estimate.setting) if r else {}, r) for name, r in runs]
    if not args.no_default and not any(r is None for _, r in runs):
        todo.append((f"{args.tag}default", {}, None))
    side = max(1, args.parallel)  # runs at a time, each on its own GPUs
    for first in range(0, len(todo), side):
        if args.deadline and time.time() - started > args.deadline:
            print(f"  deadline: {', '.join(n for n, _, _ in todo[first:])} not run", flush=True)
            break
        wave = todo[first : first + side]
        gpu_sets = [list(range(i * args.gpus, (i + 1) * args.gpus)) for i in range(len(wave))]
        leftovers = [] if args.tiny else free_gpus([g for gpus in gpu_sets for g in gpus])
        if leftovers:
            print(f"  killed processes left on the GPUs by earlier runs: {', '.join(leftovers)}", flush=True)
        procs = [launch(name, fields, args, work, data, model, gpus)
                 for (name, fields, _), gpus in zip(wave, gpu_sets, strict=True)]  # fmt: skip
        for (name, _, ranked), proc in zip(wave, procs, strict=True):
            result = finish(name, proc, args, work)
            result["leftovers_killed"] = leftovers
            stage = stage_of(name, args.zero)
            result.update(shape=args.shape, gpus=args.gpus, zero=stage, card=card.name, device=env["device"],
                          sample_tokens=span, model_params=shape.n_params,
                          side_by_side=[n for n, _, _ in wave if n != name])  # fmt: skip
            if ranked is not None:
                s = ranked.estimate.setting
                estimate = speed.step_time(shape, s, card, span)
                bucket = bucket_elements(shape.hidden, args.gpus, shape.n_params)
                result["bucket"] = bucket if not {"+bkt", "+z3b"} & {f"+{p}" for p in name.split("+")[1:]} else None
                result.update(setting=dataclasses.asdict(s), planned_peak_gib=ranked.estimate.peak / plan.GiB,
                              estimated_tokens_per_second=estimate.tokens_per_second,
                              estimated_step_seconds=estimate.seconds,
                              estimate=dataclasses.asdict(estimate))  # fmt: skip
            with open(args.out / "runs.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"  {name}: exit {result['exit_code']}, {result['wall_s']} s, "
                  f"{result.get('tokens_per_second_per_gpu', 0):.0f} tokens/s/GPU (est. "
                  f"{result.get('estimated_tokens_per_second', 0):.0f}), peak {result.get('peak_memory_gib', 0):.2f} "
                  f"GiB, retries {result.get('alloc_retries')}, plan: {result.get('plan')}", flush=True)  # fmt: skip
    (args.out / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
    shutil.make_archive(str(args.out / "logs"), "gztar", work, "logs")


def _setting_of(run: dict) -> plan.Setting:
    """A run's setting as its record wrote it (records before the levers took their training arguments' names wrote
    `keep_attention` for `keep_attention_outputs`)."""
    fields = dict(run["setting"])
    if "keep_attention" in fields:
        fields["keep_attention_outputs"] = fields.pop("keep_attention")
    return plan.Setting(**fields)


def _bucket(run: dict, shape) -> int:
    """The gradient-bucket elements a run had: `+bkt`'s 5e8, the run's record, else (runs before sft set one
    process's `"auto"` to 5e8) transformers' hidden^2."""
    if "+bkt" in run["name"]:
        return int(VARIANTS["bkt"]["ds"]["reduce_bucket_size"])
    return run.get("bucket") or shape.hidden * shape.hidden


def default_setting(run: dict) -> plan.Setting | None:
    """The setting sft's default chose in a `default` run, from its `auto settings` line (None without one)."""
    line = next((p for p in run.get("plan", []) if p.startswith("auto settings")), None)
    if line is None:
        return None
    values = dict(part.split(" = ") for part in line.split(": ", 1)[1].split(", "))
    micro = int(values["per_device_train_batch_size"])
    flag = {key: value == "True" for key, value in values.items()}
    setting = plan.Setting(gpus=run["gpus"], zero_stage=run["zero"], seq_len=4096, liger=flag["use_liger_kernel"],
                           micro_batch=micro,
                           fp8=flag["fp8"], compiled=flag["compile_decoder_layers"],
                           moment_bytes=plan.moment_bytes_of(values.get("optim")))  # fmt: skip
    tools = plan.Tools(flag["activation_checkpointing"], False, False,
                       keep_attention_outputs=flag.get("keep_attention_outputs", False))  # fmt: skip
    setting = setting.with_tools(tools)
    return dataclasses.replace(setting, accumulation=fitting.accumulation_for(setting, GLOBAL_BATCH))


def _kernel(s: plan.Setting) -> str:
    return speed.kernel_name(s.fp8, s.compiled or s.fp8, s.activation_checkpointing)


def card_key(run: dict) -> str:
    """The key in speed_constants.json of the card a run was measured on (its `device`, e.g. "2 x NVIDIA H200")."""
    device = run["device"].split(" x ", 1)[-1]
    return next(key for key in ("H200", speed.REFERENCE_CARD) if all(w in device for w in key.split()))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each fitted constant sits in the least-squares vector: the bf16 efficiency of each card (as its inverse),
    the other kernels' efficiency against bf16 (shared by the cards: one FP8 run per card cannot tell FP8's efficiency
    from its host cost), the host's seconds per layer of each kernel and of kept attention outputs (the selective
    checkpoint's dispatch of every op), per gradient bucket, ZeRO's gradient work per key
    (`sft.plan.speed.gradient_key`), the link's effective GB/s (as 1e9 / GB/s), FP8's casts (s per 1e9 elements),
    ZeRO-3's hooks (the host's s per layer and pass)."""

    cards: list[str]
    kernels: list[str]  # every kernel of the runs; the first is bf16
    gradients: list[str]

    @property
    def hosts(self) -> list[str]:
        return [*self.kernels, speed.KEPT_ATTENTION]

    @property
    def size(self) -> int:
        return len(self.cards) + len(self.kernels) - 1 + len(self.hosts) + 1 + len(self.gradients) + 3

    def cards_of(self, theta, previous: dict, half: float) -> dict:
        c, k = len(self.cards), len(self.kernels)
        ratio = {"bf16": 1.0, **{name: 1 / theta[c + i] for i, name in enumerate(self.kernels[1:])}}
        host = {name: float(theta[c + k - 1 + i]) for i, name in enumerate(self.hosts)}
        at = c + k - 1 + len(self.hosts)
        gradients = {key: float(theta[at + 1 + i]) for i, key in enumerate(self.gradients)}
        link = 1.0 / max(theta[at + 1 + len(self.gradients)], 1e-9)
        cast = float(theta[at + 2 + len(self.gradients)])
        zero3_host = float(theta[at + 3 + len(self.gradients)])
        out = {}
        for i, name in enumerate(self.cards):
            card = previous[name]
            out[name] = dataclasses.replace(
                card, half_tokens=half, bucket_s=float(theta[at]), link_gbps=link, host_s_per_layer=host,
                fp8_cast_s_per_gelement=cast, zero3_host_s_per_layer_pass=zero3_host,
                efficiency={**card.efficiency, **{kernel: r / theta[i] for kernel, r in ratio.items()}},
                gradient_s_per_gparam={**card.gradient_s_per_gparam, **gradients},
            )  # fmt: skip
        return out


def _model(cards: dict, inputs: list[tuple]) -> np.ndarray:
    """Each run's step seconds as the plan estimates them (`sft.plan.speed.step_time`) with its card's constants."""
    return np.array([
        speed.step_time(shape, setting, cards[key], tokens, bucket).seconds
        for shape, setting, key, tokens, bucket in inputs
    ])  # fmt: skip


def _inputs(runs: list[dict], shapes_: dict) -> list[tuple]:
    """What `_model` needs of each run besides the constants (its shape, setting, card, tokens, buckets), made once
    per fit rather than at each of the residual's 2,700 evaluations."""
    return [(shapes_[r["shape"]], _setting_of(r), card_key(r), r["sample_tokens"], _bucket(r, shapes_[r["shape"]]))
            for r in runs]  # fmt: skip


def resolved(run: dict) -> dict | None:
    """The run with its setting: its own, or for sft's default runs the one their log names (and the buckets the
    package of the run set: transformers' hidden^2 for the previous package's, `old-`); None without either."""
    if run.get("setting"):
        return run
    setting = default_setting(run)
    if setting is None:
        return None
    run = {**run, "setting": dataclasses.asdict(setting)}
    if not run["name"].startswith("old-"):
        run["bucket"] = bucket_elements(SHAPES[run["shape"]]["hidden_size"], run["gpus"], run["model_params"])
    return run


def median_tokens_per_second(run: dict) -> float | None:
    """Tokens/s per GPU of the run's median step (what the fit uses: a step that compiled again does not count)."""
    if not run.get("step_seconds_each") or not run.get("tokens_per_step"):
        return None
    return run["tokens_per_step"] / run["gpus"] / float(np.median(run["step_seconds_each"]))


def fit_runs(paths: list[Path], held_out: bool = False) -> list[dict]:
    """The runs a fit uses: those with step times and a setting (`resolved`); `held_out`: instead those with 8-bit
    Adam moments (`+adam8`, or a default that `optim: auto` gave them), which check the fit rather than feed it: the
    model has no term for torchao's 8-bit step and times it as fp32 Adam's."""
    runs = (resolved(r) for path in paths for r in read_jsonl(Path(path)) if r.get("step_seconds"))
    return [r for r in runs if r is not None and (r["setting"].get("moment_bytes", 8) < 8) == held_out]


def fit(args) -> None:
    """Least squares on the relative error of the median step (non-negative constants) over every run with a setting,
    of every card at once (`Layout`: what the cards share, what each has); the half-efficiency tokens by a grid. The
    constants are written for each card measured, the table printed."""
    from scipy.optimize import least_squares

    runs = fit_runs(args.fit)
    shapes_ = {name: load_shape(str(model_dir(Path(tempfile.mkdtemp()) / name, SHAPES[name])))
               for name in {r["shape"] for r in runs}}  # fmt: skip
    kernels = sorted({_kernel(_setting_of(r)) for r in runs}, key=lambda k: (k != "bf16", k))
    gradients = sorted({speed.gradient_key(_setting_of(r)) for r in runs if r["setting"]["zero_stage"]})
    layout = Layout(sorted({card_key(r) for r in runs}), kernels, gradients)
    table = json.loads(speed.CONSTANTS.read_text())  # the other cards and the constants this sweep does not fit
    # every run steps the optimizer once per 131,072 tokens, so its cost cannot be told apart from the compute's: it is
    # the card's (`optimizer_s_per_gparam`, from its memory bandwidth), not fitted; `overlap` is not either (only the
    # exposed share of the collectives shows: the link's GB/s are fitted with it)
    reference = table["cards"][speed.REFERENCE_CARD]
    entries = {name: table["cards"].get(name) or {**reference, **CARD_DEFAULTS.get(name, {})} for name in layout.cards}
    previous = {name: speed.Card(name, **entry) for name, entry in entries.items()}
    measured = np.array([float(np.median(r["step_seconds_each"])) for r in runs])  # robust to a step that recompiled
    inputs = _inputs(runs, shapes_)
    lower = np.zeros(layout.size)
    lower[: len(layout.cards) + len(kernels) - 1] = 1.0  # efficiencies at most 1 (and no kernel above bf16's peak x 1)
    lower[len(layout.cards) : len(layout.cards) + len(kernels) - 1] = 0.25  # another kernel at most 4x bf16's
    best = None
    for half in (0.0, 256.0, 1024.0, 4096.0):

        def residual(theta, half=half):
            return _model(layout.cards_of(theta, previous, half), inputs) / measured - 1

        for host in (1e-3, 1e-2):  # the max() has local minima: a few starts
            start = np.concatenate([[1.6] * len(layout.cards), [1.0] * (len(kernels) - 1), [host] * len(layout.hosts),
                                    [5e-4], [0.01] * len(layout.gradients), [1 / 150], [1e-3], [1e-3]])  # fmt: skip
            result = least_squares(residual, start, bounds=(lower, np.inf))
            if best is None or result.cost < best[2]:
                best = (half, result.x, result.cost)
    half, x, _ = best
    residual = _model(layout.cards_of(x, previous, half), inputs)
    for i in range(len(layout.hosts)):  # a host cost that never shows keeps no made-up value (its start) but 0
        trial = x.copy()
        trial[len(layout.cards) + len(kernels) - 1 + i] = 0.0
        if np.allclose(_model(layout.cards_of(trial, previous, half), inputs), residual, rtol=0, atol=1e-9):
            x = trial
    fitted = layout.cards_of(x, previous, half)
    source = args.source or ", ".join(str(p) for p in args.fit)
    for name, card in fitted.items():
        entry = dict(entries[name])
        entry.pop("micro_fixed_s", None)  # replaced by host_s_per_layer
        entry["efficiency"] = {k: _sig(v) for k, v in card.efficiency.items()}
        entry["half_tokens"], entry["bucket_s"], entry["link_gbps"] = half, _sig(card.bucket_s), _sig(card.link_gbps)
        entry["fp8_cast_s_per_gelement"] = _sig(card.fp8_cast_s_per_gelement)
        entry["zero3_host_s_per_layer_pass"] = _sig(card.zero3_host_s_per_layer_pass)
        entry["host_s_per_layer"] = {k: _sig(v) for k, v in card.host_s_per_layer.items()}
        entry["gradient_s_per_gparam"] = {k: _sig(v) for k, v in sorted(card.gradient_s_per_gparam.items())}
        entry["source"] = source
        table["cards"][name] = dict(sorted(entry.items()))
    (args.write or speed.CONSTANTS).write_text(json.dumps(table, indent=2) + "\n")
    speed._table.cache_clear()
    print(json.dumps({name: table["cards"][name] for name in fitted}, indent=2))
    if not args.write:
        report(args.fit)


# A card fitted for the first time starts from the reference card's entry with these values (its own spec)
CARD_DEFAULTS = {"H200": {"optimizer_s_per_gparam": 36e9 / 4.8e12}}  # 36 bytes a parameter at 4.8 TB/s


def _sig(value: float) -> float:
    return float(f"{float(value):.4g}")


def report(paths: list[Path]) -> str:
    """Each run's measured tokens/s (mean of the timed steps, and of its median step) and peak beside the plan's
    estimates with the constants in the file now; each default's choice against the fastest setting measured under its
    stage in the same file. Printed and returned (markdown)."""
    lines = []
    for path in paths:
        runs = read_jsonl(path)
        if not runs:
            continue
        first = runs[0]
        card = speed.card(None if first["card"] == "cpu" else card_key(first))
        shape = load_shape(str(model_dir(Path(tempfile.mkdtemp()) / first["shape"], SHAPES[first["shape"]])))
        stages = "/".join(f"ZeRO-{z}" for z in sorted({r["zero"] for r in runs}))
        lines += [
            f"## {first['shape']}, {first['gpus']} GPU(s), {stages}: {first['device']} ({path})", "",
            "| run | exit | tokens/s/GPU | median step | est. tokens/s | est. / median | MFU | peak GiB | planned GiB "
            "| reserved GiB | alloc retries |", "|" + " --- |" * 11,
        ]  # fmt: skip
        measured = {}
        for run in runs:
            got, median = run.get("tokens_per_second_per_gpu"), median_tokens_per_second(run)
            with_setting = resolved(run)
            est = "- | -"
            if with_setting is not None:
                e = speed.step_time(shape, _setting_of(with_setting), card, run["sample_tokens"],
                                    _bucket(with_setting, shape)).tokens_per_second  # fmt: skip
                est = f"{e:,.0f} | {e / median:.3f}" if median else f"{e:,.0f} | -"
            if got:
                measured[run["name"]] = got
            mfu = f"{run['mfu']:.1%}" if run.get("mfu") else "-"
            retries = (run.get("alloc_retries") or [None])[-1]
            lines.append(f"| {run['name']} | {run['exit_code']} | {got or 0:,.0f} | {median or 0:,.0f} | {est} "
                         f"| {mfu} | {run.get('peak_memory_gib', 0):.2f} | {run.get('planned_peak_gib', 0):.2f} | "
                         f"{run.get('peak_reserved_gib', 0):.2f} | {retries} |")  # fmt: skip
        for name in [n for n in measured if n.endswith("default")]:
            run = next(r for r in runs if r["name"] == name)
            plan_line = next((p for p in run.get("plan", []) if p.startswith("auto settings")), "")
            lines += ["", f"{name}: {measured[name]:,.0f} tokens/s/GPU, MFU {run['mfu']:.1%}; {plan_line}"]
            rivals = [n for n in measured if n.split("+")[0] != name and not n.endswith("default")
                      and next(r for r in runs if r["name"] == n)["zero"] == run["zero"]]  # fmt: skip
            if rivals:
                fastest = max(rivals, key=measured.get)
                lines[-1] += (f"; {measured[name] / measured[fastest]:.3f} x the fastest other setting under ZeRO-"
                              f"{run['zero']} in this file ({fastest}, {measured[fastest]:,.0f})")  # fmt: skip
        lines.append("")
    text = "\n".join(lines)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--zero", type=int, choices=[1, 2, 3], default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--gpu-memory", type=float, help="GiB the plan plans for (default: the GPU's)")
    parser.add_argument("--headroom", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="Logged steps left out of the averages")
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--max-runs", type=int, default=8)
    parser.add_argument("--run-timeout", type=float, default=300)
    parser.add_argument("--no-default", action="store_true", help="Leave out the run with sft's defaults")
    parser.add_argument("--default-only", action="store_true", help="Only the run with sft's defaults")
    parser.add_argument("--tag", default="", help="Prefix of the default run's name (e.g. old- for SFT_CODE's)")
    parser.add_argument("--only", nargs="*", help="These settings (names as z2-m8-ckpt-fp8, +exp: expandable "
                                                   "segments) instead of the plan's candidates")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="Demo-sized model in fp32 on CPU: a smoke test")
    parser.add_argument("--parallel", type=int, default=1, help="Runs at a time, each on its own --gpus GPUs")
    parser.add_argument("--deadline", type=float, help="Seconds after which no further run starts")
    parser.add_argument(
        "--keep-save",
        dest="stop_after_steps",
        action="store_false",
        help="Let each run save its model (default: stopped once its last step is logged)",
    )
    parser.add_argument("--fit", nargs="*", type=Path, help="Fit the constants from these runs.jsonl; run nothing")
    parser.add_argument("--source", help="With --fit: what the constants came from (default: the files)")
    parser.add_argument("--write", type=Path, help=f"With --fit: write here instead of {speed.CONSTANTS.name}")
    parser.add_argument("--report", nargs="*", type=Path, help="Plan vs measured of these runs.jsonl; run nothing")
    args = parser.parse_args(argv)
    if args.fit:
        fit(args)
    elif args.report:
        report(args.report)
    elif args.out is None:
        sys.exit("--out is needed to measure")
    else:
        if args.tiny:
            args.seq_len, args.gpu_memory, args.steps = 512, args.gpu_memory or 0.15, min(args.steps, 3)
            args.shape = "tiny"
        started = time.time()
        measure(args)
        print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
