"""DeepSpeed's configuration: the `--deepspeed` JSON checked and resolved once, and what the plan decides written in.

- `prepare_config`: the `--deepspeed` JSON checked (exists, is an object, no DeepCompile: refused with what was
  measured) and sft's own `"auto"` values resolved (`unresolved_config` gives them back as `"auto"` when the plan
  changes what they depend on); `check_agrees`: after transformers has filled its `"auto"` values, a DeepSpeed value
  that contradicts a training argument is an error naming both.
- `zero_setup`: the ZeRO stage and what is offloaded (for the memory plan and the model build).
- `offload_auto` / `place_offload`, `fill_buckets`, `universal_load_config`: the plan's decisions written into the
  config (ZeRO's offload devices, bucket sizes for narrow models, a universal-checkpoint load).
- `ZERO3_MEASURED` / `zero3_cost`: what ZeRO-3 cost against ZeRO-2 in sft's own benchmarks, for the advice at start
  when the plan shows ZeRO-2 fits.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from sft.engines.base import Sharding
from sft.errors import ConfigError

logger = logging.getLogger(__name__)


ZeroSetup = Sharding  # the ZeRO stage (None: no DeepSpeed) and what is offloaded to the CPU


@dataclass(frozen=True)
class Zero3Cost:
    """One measured pair: sft's default run under ZeRO-3 and under ZeRO-2, same model, GPUs, data and micro batch."""

    params_b: float  # model size, billions of parameters (the Llama-3.x shape of the benchmark)
    gpus: int
    ratio: float  # ZeRO-3 tokens/s per GPU / ZeRO-2's

    def describe(self) -> str:
        return (
            f"{self.params_b:g}B on {self.gpus} x H200 with sft's defaults (FP8 under ZeRO-2 only): ZeRO-3 at "
            f"{self.ratio:.2f} of ZeRO-2's tokens/s"
        )


# sft's defaults side by side (H200, seq 4096, global batch 32 packed rows, full fine-tuning, Liger): under ZeRO-2 the
# defaults train in FP8 with compiled decoder layers (hidden >= 2048), under ZeRO-3 in bf16 (`sft.model.fp8`). 1B and
# 3B: benchmarks/results/zero3_levers/throughput.json; 8B: the defaults the speed model chose, side by side
# (benchmarks/results/speed_sweep_h200x4/call2_8b_defaults: ZeRO-2 FP8 at micro batch 2, ZeRO-3 bf16 at micro batch 16
# with attention outputs kept). tests/test_engine.py checks these against those files.
ZERO3_MEASURED = (
    Zero3Cost(1, 1, 0.959),
    Zero3Cost(3, 1, 0.794),
    Zero3Cost(8, 2, 0.733),
)


def zero3_cost(params: int, gpus: int) -> Zero3Cost:
    """The measurement nearest to this run: the closest GPU count, then the closest model size (by ratio of sizes)."""

    def distance(m: Zero3Cost) -> tuple[int, float]:
        return abs(math.log2(m.gpus / gpus)), abs(math.log(m.params_b * 1e9 / max(params, 1)))

    return min(ZERO3_MEASURED, key=distance)


def _refuse_deepcompile(config: dict, where: str) -> None:
    """DeepCompile (`"compile": {"deepcompile": true}`) is refused, with what was measured (issue #23).

    Tried on 1 x H200 (DeepSpeed 0.19.8, transformers 5.23; benchmarks/results/zero3_levers/): accelerate starts it
    only with `torch_compile` on; the traced forward of transformers' Llama breaks at its output-capturing wrapper,
    and the input embedding then runs outside the compiled graph on ZeRO-3's partition, which DeepCompile no longer
    gathers by hooks ("Padding_idx must be within num_embeddings"; with padding_idx dropped, "'weight' must be 2-D").
    """
    if not (config.get("compile") or {}).get("deepcompile"):
        return
    raise ConfigError(
        f"`deepspeed`: {where} asks for DeepCompile (compile.deepcompile), which sft does not run: with DeepSpeed "
        "0.19.8 and transformers' Llama it failed at the first step (the model's forward breaks the compiled graph "
        "and the input embedding then runs on ZeRO-3's ungathered partition). Remove the compile section; "
        "compile_decoder_layers compiles the decoder layers under ZeRO-3 instead."
    )


def _check_file(path: str) -> Path:
    ds_path = Path(path)
    if not ds_path.is_file():
        raise ConfigError(
            f"`deepspeed`: no such file {path!r}. Use one of ds_configs/*.json (zero2, zero3, *_offload) or a path "
            "to your own DeepSpeed JSON."
        )
    try:
        config = _parsed(ds_path)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"`deepspeed`: {path} is not valid JSON ({e}). Fix the file or pick one of ds_configs/."
        ) from e
    if not isinstance(config, dict):
        raise ConfigError(f"`deepspeed`: {path} must hold a JSON object, got {type(config).__name__}.")
    return ds_path


@functools.lru_cache(maxsize=8)
def _parse_file(path: str, mtime_ns: int, size: int) -> dict:
    """A DeepSpeed JSON file parsed, once per process for each version of the file (the cache key)."""
    return json.loads(Path(path).read_text())


def _parsed(path: str | Path) -> dict:
    stat = Path(path).stat()
    return _parse_file(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


def read_config(deepspeed: str | dict) -> dict:
    """A fresh copy of the DeepSpeed config, whether `deepspeed` is a JSON path (parsed once, `_parse_file`) or an
    already-loaded dict."""
    return copy.deepcopy(deepspeed if isinstance(deepspeed, dict) else _parsed(deepspeed))


def prepare_config(
    deepspeed: str | dict | None, processes: int, sp: int = 1, ep: int = 1
) -> tuple[str | dict | None, dict]:
    """The `deepspeed` training argument checked and resolved for a run of `processes` processes, sequence-parallel
    size `sp` and expert-parallel size `ep` (AutoEP's section written by `sft.engines.deepspeed.autoep`); returns
    (config for transformers, {setting: value sft chose}). `none`/empty turns DeepSpeed off.

    `zero_optimization.overlap_comm: "auto"`: on with several processes (the gradient reduction overlaps the
    backward), off with one, where there is nothing to communicate and DeepSpeed's overlap path only adds stream
    synchronisation: 1B shape on 1 x H100, ZeRO-2, 62,609 vs 60,711 tokens/s without/with it
    (benchmarks/results/profile_step_1b_h100). Off, too, under sequence parallelism on ZeRO-1/2, and `true` there is
    refused: DeepSpeed's overlapped reduction of ZeRO-1/2 gives wrong gradients when the backward runs Ulysses'
    all-to-alls (measured on 2 x H200: gradient norm 11,341 against 2.5997 without SP; 2.5997 with overlap off;
    benchmarks/results/sp_gradients). A config without `"auto"` is returned as given (a path stays a path).
    """
    if deepspeed is None or (isinstance(deepspeed, str) and deepspeed.lower() in ("", "none", "null")):
        return None, {}
    if isinstance(deepspeed, str):
        deepspeed = str(_check_file(deepspeed))
    config = read_config(deepspeed)
    zero = config.get("zero_optimization")
    value = zero.get("overlap_comm") if isinstance(zero, dict) else None
    where = deepspeed if isinstance(deepspeed, str) else "the DeepSpeed config"
    _refuse_deepcompile(config, where)
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    if isinstance(bf16, dict) and bf16.get("check_grad_overflow") is False:
        raise ConfigError(
            f"`deepspeed`: bf16.check_grad_overflow: false in {where} lets DeepSpeed apply a step whose gradients "
            "are NaN or infinite to the weights; sft skips such steps and stops at max_nonfinite_steps "
            "(sft.run.failsafe), which needs DeepSpeed's check. Remove the key (true is DeepSpeed's default)."
        )
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    _check_zero_values(zero if isinstance(zero, dict) else {}, where)
    breaks = sp > 1 and stage in (1, 2)  # the overlapped reduction under sequence parallelism: wrong gradients
    if value is True and breaks:
        raise ConfigError(
            f"`deepspeed`: zero_optimization.overlap_comm: true in {where} with sequence_parallel_size {sp}: "
            f"DeepSpeed's overlapped ZeRO-{stage} gradient reduction gives wrong gradients under sequence parallelism "
            '(measured on GPUs, benchmarks/results/sp_gradients). Set it to "auto" or false.'
        )
    if ep > 1 or config.get("expert_parallel") is not None:
        from sft.engines.deepspeed import autoep

        deepspeed = autoep.prepare_config(config, ep, where)
    if value is None or isinstance(value, bool):
        return deepspeed, {}
    if value != "auto":
        raise ConfigError(
            f'`deepspeed`: zero_optimization.overlap_comm in {where} must be true, false or "auto", got {value!r}.'
        )
    zero["overlap_comm"] = processes > 1 and not breaks
    return config, {"zero_optimization.overlap_comm": zero["overlap_comm"]}


def _check_zero_values(zero: dict, where: str) -> None:
    """The `zero_optimization` values DeepSpeed would only reject deep inside its engine (or the MPI probe)."""
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(
            f"`deepspeed`: zero_optimization.stage in {where} is {stage!r}; ZeRO has stages 0, 1, 2 and 3 "
            "(ds_configs/zero2.json and zero3.json are the usual ones)."
        )
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section) or {}
        device = str(offload.get("device", "none")).lower()
        if device not in ("none", "cpu", "nvme", "auto"):
            raise ConfigError(
                f"`deepspeed`: zero_optimization.{section}.device in {where} is {device!r}; use cpu, nvme, none or "
                '"auto" (the memory plan offloads to the CPU only if the run does not fit without it).'
            )
        if device == "nvme" and not offload.get("nvme_path"):
            raise ConfigError(
                f"`deepspeed`: zero_optimization.{section} offloads to nvme in {where} but gives no `nvme_path`: add "
                '"nvme_path": "/local_nvme" (a fast local disk), or offload to "cpu".'
            )
        if section == "offload_param" and device != "none" and stage != 3:
            raise ConfigError(
                f"`deepspeed`: zero_optimization.offload_param in {where} needs ZeRO stage 3 (the stage is {stage}); "
                "use ds_configs/zero3_offload.json, or offload_optimizer only."
            )


# transformers fills `reduce_bucket_size: "auto"` with hidden^2 elements and ZeRO-3's `stage3_prefetch_bucket_size:
# "auto"` with 0.9 x that: for a narrow model one collective per few KB of gradients (16,384 elements, 64 KB, at the
# demo's width of 128). sft fills them first, with at least BUCKET_FLOOR elements: the same values from a width of
# 1,024 up; on the demo (2 CPU processes, 60 steps) ZeRO-2 trained in 23.3 s instead of 29.3 and ZeRO-3 in 27.4
# instead of 39.2, losses, gradient norms and weights bit-identical.
BUCKET_FLOOR = 2**20
BUCKETS = {"reduce_bucket_size": 1.0, "stage3_prefetch_bucket_size": 0.9}  # key: transformers' share of hidden^2
# ZeRO-1/2 on one process: nothing to overlap, so `reduce_bucket_size: "auto"` is DeepSpeed's own default, 5e8
# elements: one reduction per 5e8 gradients instead of one per hidden^2 (341 a micro step at Llama-3.2-3B's width).
# Measured on 1 x H100, 3B widths, ZeRO-2, rows of 4,096 (benchmarks/results/speed_sweep_h100): micro batch 1 from
# 12,357 to 17,249 tokens/s, micro batch 8 with attention outputs kept from 21,248 to 21,945; peaks 65.90 -> 65.90
# and 68.01 -> 67.41 GiB.
ONE_PROCESS_BUCKET = 500_000_000


def bucket_elements(
    hidden: int, key: str = "reduce_bucket_size", processes: int = 2, stage: int = 2, params: int | None = None
) -> int:
    """What an `"auto"` bucket size of `zero_optimization` becomes for a model of width `hidden` on `processes`; on
    one process never more than the model's `params` (DeepSpeed allocates the whole bucket at each backward)."""
    if key == "reduce_bucket_size" and processes == 1 and stage in (1, 2):
        return min(ONE_PROCESS_BUCKET, max(params or ONE_PROCESS_BUCKET, BUCKET_FLOOR))
    return max(int(BUCKETS[key] * hidden * hidden), BUCKET_FLOOR)


def fill_buckets(
    deepspeed: str | dict | None, hidden: int, processes: int = 2, params: int | None = None
) -> tuple[str | dict | None, dict]:
    """The config with its `"auto"` bucket sizes set (`bucket_elements`), where the floor or one process changes
    them; returns (config, {setting: value}), the config unchanged (a path stays a path) and {} where it does not."""
    if not deepspeed:
        return deepspeed, {}
    config = read_config(deepspeed)
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return deepspeed, {}
    stage = zero.get("stage", 0)
    keys = [k for k in BUCKETS if zero.get(k) == "auto" and (stage == 3 or k == "reduce_bucket_size")]
    floor = hidden * hidden < BUCKET_FLOOR  # transformers' hidden^2 is below the floor
    one = processes == 1 and stage in (1, 2)
    keys = [k for k in keys if floor or (one and k == "reduce_bucket_size")]
    for key in keys:
        zero[key] = bucket_elements(hidden, key, processes, stage, params)
    return (config, {f"zero_optimization.{k}": zero[k] for k in keys}) if keys else (deepspeed, {})


def unresolved_config(training_args) -> str | dict | None:
    """The run's DeepSpeed config with the values sft resolved from `"auto"` set back to `"auto"`, to be resolved
    again when a setting they depend on changes (`sequence_parallel_size: auto`, chosen by the memory plan)."""
    if not training_args.deepspeed or not training_args.resolved_ds_settings:
        return training_args.deepspeed
    config = read_config(training_args.deepspeed)
    for key in training_args.resolved_ds_settings:
        section, name = key.split(".")
        config[section][name] = "auto"
    return config


def check_agrees(training_args) -> None:
    """A non-`"auto"` DeepSpeed value that contradicts a training argument (transformers found it) is an error."""
    mismatches = getattr(getattr(training_args, "hf_deepspeed_config", None), "mismatches", None)
    if mismatches:
        raise ConfigError(
            f"The DeepSpeed config {training_args.deepspeed} contradicts the training arguments: "
            + "; ".join(m.strip("- ") for m in mismatches)
            + '. Set those DeepSpeed values to "auto" so the training arguments own them.'
        )


OFFLOAD_SECTIONS = ("offload_optimizer", "offload_param")


def offload_auto(deepspeed: str | dict | None) -> tuple[bool, bool]:
    """Whether the config's `zero_optimization.offload_optimizer` / `offload_param` devices are `"auto"`: offloaded to
    the CPU only where the memory plan needs it (ds_configs/zero3.json), set by `place_offload`."""
    if not deepspeed:
        return False, False
    zero = read_config(deepspeed).get("zero_optimization") or {}
    return tuple(str((zero.get(key) or {}).get("device", "none")).lower() == "auto" for key in OFFLOAD_SECTIONS)


def place_offload(deepspeed: str | dict, optimizer: bool, params: bool, ratio: float = 1.0) -> dict:
    """The config with its `"auto"` offload devices decided: `cpu` (pinned) where the plan turned the lever on, `none`
    elsewhere; an offloaded optimizer under ZeRO-3 gets `ratio`, its share of the states on the CPU (DeepSpeed's
    partial offload, whole sub-groups). With the optimizer offloaded and no `optimizer` section, DeepSpeed's AdamW
    (its CPU Adam, which offload needs) with every value from the training arguments, as ds_configs/*_offload.json."""
    config = read_config(deepspeed)
    zero = config["zero_optimization"]
    for key, on in zip(OFFLOAD_SECTIONS, (optimizer, params), strict=True):
        section = zero.get(key) or {}
        if str(section.get("device", "none")).lower() != "auto":
            continue
        section = {**section, "device": "cpu" if on else "none"}
        if on:
            section.setdefault("pin_memory", True)
        if key == "offload_optimizer" and on and ratio < 1:
            section["ratio"] = ratio
        zero[key] = section
    if zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme") and "optimizer" not in config:
        config["optimizer"] = {
            "type": "AdamW",
            "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto"),
        }
    return config


def zero_setup(training_args) -> ZeroSetup:
    """The ZeRO stage and offloading of the run's (resolved) DeepSpeed config."""
    if not training_args.deepspeed:
        return ZeroSetup()
    zero = training_args.hf_deepspeed_config.config.get("zero_optimization", {})

    def offloaded(key: str) -> bool:
        return str(zero.get(key, {}).get("device", "none")).lower() in ("cpu", "nvme")

    ratio = float((zero.get("offload_optimizer") or {}).get("ratio", 1.0))
    return ZeroSetup(int(zero.get("stage", 0)), offloaded("offload_optimizer"), offloaded("offload_param"), ratio)


def universal_load_config(deepspeed: str | dict) -> dict:
    """The run's DeepSpeed config set to load its checkpoint as a universal one (written by another process count)."""
    config = read_config(deepspeed)
    config.setdefault("checkpoint", {})["load_universal"] = True
    return config
