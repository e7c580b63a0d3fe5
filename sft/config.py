"""Configuration: TRL's dataclasses, subclassed to add only what sft needs, and the parser that reads them.

``parse_args`` reads ``--config recipe.yaml`` plus command-line overrides with TRL's ``TrlParser``. Unknown YAML keys
and flags are errors (with a "did you mean" hint), and every check that can run before a process group, a model or
a data set exists runs here, so a bad value fails in seconds with a message that names the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser
from trl.scripts.utils import DatasetConfig

from sft.core import logs
from sft.core.dims import ParallelDims
from sft.core.recipe import missing_local_source, read_recipe, read_recipe_in, recipe_path, with_config
from sft.errors import ConfigError

logger = logging.getLogger(__name__)
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 scaling recipes, the measured faster first
# `optim: auto` until the plan decides: transformers' default, fused AdamW with fp32 moments
DEFAULT_OPTIM = "adamw_torch_fused"


@dataclass
class DataArguments(DatasetMixtureConfig):
    """
    TRL's dataset mixture, plus a given eval set.

    Each entry of `datasets` (and of `eval_datasets`) has `path` (a local `.jsonl`/`.json`/`.parquet`/`.csv` file, a
    `datasets.save_to_disk` directory, or a hub id), and optionally `name`, `data_dir`, `data_files`, `split`,
    `columns` and `fraction`. Records may be conversational (`messages`), ShareGPT (`conversations` of
    `from`/`value`), Alpaca (`instruction`/`input`/`output`), prompt/completion, or plain `text`.

    Parameters:
        eval_datasets (`list[DatasetConfig]`):
            Sources of the eval set. When empty, `test_split_size` carves the eval set out of the training mixture.
    """

    eval_datasets: list[DatasetConfig] = field(
        default_factory=list,
        metadata={
            "help": "Sources of the eval set (same keys as `datasets`). If empty, `test_split_size` carves one."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.eval_datasets = [DatasetConfig(**d) if isinstance(d, dict) else d for d in self.eval_datasets]
        fractions = [d.fraction for d in self.datasets]
        if any(f is not None for f in fractions):
            if any(f is None for f in fractions):
                raise ConfigError(
                    f"`fraction` is set on some entries of `datasets` but not on others ({fractions}). Set it on all "
                    "of them (shares of the mixture, normalised to sum to one) or on none."
                )
            bad = [f for f in fractions if not f > 0]
            if bad:
                raise ConfigError(f"`datasets[].fraction` must be > 0, got {bad[0]}. Drop the source instead.")
        if self.test_split_size is not None and not self.test_split_size > 0:
            raise ConfigError(
                f"`test_split_size` must be a fraction in (0, 1) or a record count >= 1, got {self.test_split_size}."
            )
        if self.test_split_size is not None and self.eval_datasets:
            raise ConfigError(
                "Both `eval_datasets` and `test_split_size` are set. Give the eval set one way: remove one of them."
            )


@dataclass
class ModelArguments(ModelConfig):
    """
    TRL's model arguments, plus building a model from its config alone.

    Parameters:
        from_scratch (`bool`, *optional*, defaults to `False`):
            Build the model from `config.json` in `model_name_or_path` with freshly initialised weights instead of
            loading weights. Used by the demo and the benchmarks; the tokenizer still comes from that directory.
        attn_implementation (`str`, *optional*, defaults to `"auto"`):
            TRL's field with a new default: `auto` picks the fastest backend that keeps packed samples apart
            (see `sft.model.attention`).
    """

    from_scratch: bool = field(
        default=False,
        metadata={"help": "Build the model from `config.json` in `model_name_or_path` with random weights."},
    )
    attn_implementation: str | None = field(
        default="auto",
        metadata={
            "help": "`auto`: flash_attention_2 if flash-attn is installed, else PyTorch's varlen FlashAttention-2 "
            "(`sft_varlen`) on CUDA, else sdpa. Or any transformers backend name."
        },
    )


ENGINE_HELP = (
    "What shards and steps the model: deepspeed (the `deepspeed` config; none: not sharded), fsdp2 (PyTorch's FSDP2 "
    "through accelerate; `fsdp_config` as sft writes it), or `auto`: DeepSpeed, except FSDP2 in place of ZeRO-3 where "
    "the plan estimates it faster on a GPU."
)


@dataclass
class TrainConfig(SFTConfig):
    """
    TRL's `SFTConfig`, checked early, with a global-batch target and a memory plan.

    Before transformers sets anything up, the DeepSpeed config file is checked (it exists and is JSON); right after,
    any non-`"auto"` DeepSpeed value that contradicts a training argument is reported with both values.
    `sft.plan.preflight` then turns `global_batch_size`/`tokens_per_step` into accumulation steps (`sft.core.batch`),
    sizes the run with `sft.plan.memory` and resolves the `auto` values below.

    Parameters:
        per_device_train_batch_size (`int` or `"auto"`, *optional*, defaults to `"auto"`):
            Rows per GPU per forward pass. `auto`: the largest micro batch that the memory plan fits on this GPU
            (and that divides the global batch); 1 without a GPU to plan for.
        activation_checkpointing (`bool` or `"auto"`, *optional*, defaults to `"auto"`):
            Recompute activations in the backward pass. `auto`: only if the plan does not fit without it.
        offload_checkpoints (`bool` or `"auto"`, *optional*, defaults to `"auto"`):
            Keep what activation checkpointing saves (each decoder layer's input) in pinned CPU memory, copied back
            in the backward (transformers' `activation_checkpointing_kwargs` `offload`). `true` turns an `auto`
            checkpointing on. `auto`: only if the plan does not fit with checkpointing alone. On a GPU it also turns
            on PyTorch's expandable segments (unless `PYTORCH_CUDA_ALLOC_CONF` is set), against fragmentation.
        keep_attention_outputs (`bool` or `"auto"`, *optional*, defaults to `"auto"`):
            With activation checkpointing, keep each decoder layer's attention output (the attention kernel's
            output and log-sum-exp) instead of recomputing it in the backward (`sft.model.checkpointing`): the
            recomputation then skips the attention kernel, most of a layer's work on long rows, for one more
            [tokens x heads x head_dim] tensor per layer. Not with `offload_checkpoints`. `auto`: with checkpointing,
            wherever the plan fits it.
        tiled_mlp (`bool` or `"auto"`, *optional*, defaults to `"auto"`):
            Run each decoder layer's MLP over the row in tiles of about `hidden_size` tokens (DeepSpeed ALST's
            `TiledMLP`, see `sft.model.tiling`), so its intermediate activations never exist for the whole row at once.
            `auto`: only if the plan does not fit with checkpointing and offloading.
        global_batch_size (`int`, *optional*):
            Samples (packed rows) per optimizer step; accumulation steps are derived from the world size and micro
            batch, so the same target gives the same global batch on any number of GPUs.
        tokens_per_step (`int`, *optional*):
            Tokens per optimizer step with packing (global batch x `max_length`); the alternative to
            `global_batch_size`.
        plan_gpu_memory_gib (`float`, *optional*):
            GPU memory to plan for, in GiB. Defaults to the memory of this machine's GPU.
        max_gpu_memory_gib (`float`, *optional*):
            Cap what each process may allocate on its GPU, in GiB (`torch.cuda.set_per_process_memory_fraction`):
            for a GPU shared with other work, or to rehearse a smaller GPU on a bigger one. The memory plan plans
            for the cap (unless `plan_gpu_memory_gib` says otherwise); an allocation past it is an out-of-memory
            error, as on a GPU of that size.
        plan_headroom (`float`, *optional*, defaults to `0.1`):
            Fraction of GPU memory the plan leaves free (CUDA context, NCCL, allocator fragmentation).
        plan_check (`bool`, *optional*, defaults to `True`):
            Refuse to start when the planned peak does not fit. The plan is an estimate: `false` starts anyway.
        resume_from_checkpoint (`str`, *optional*, defaults to `"auto"`):
            `auto`: resume from the newest complete checkpoint in `output_dir`, or start fresh if there is none;
            a path: resume from that checkpoint; `none`: start fresh (in an empty or new `output_dir`).
        use_liger_kernel (`bool`, *optional*):
            transformers' field with a new default: unset means on when a CUDA GPU and liger-kernel are present
            (Liger's RMSNorm, RoPE and SwiGLU kernels; TRL keeps its own fused LM-head loss), off otherwise.
        peak_tflops (`float`, *optional*):
            Peak TFLOP/s of one GPU that MFU is computed against. Defaults to the dense bf16 peak of the GPU found
            (H100/H200 989, A100 312; see `sft.model.flops`); MFU is not logged for a GPU not on file unless this is
            set.
        compile_decoder_layers (`bool` or `"auto"`, *optional*, defaults to `"auto"`):
            `torch.compile` each decoder layer (not the whole model, unlike transformers' `torch_compile`). `auto`:
            on with FP8 (its casts and scales are fast only compiled), off otherwise (bf16 measured no faster).
        packing_check (`bool` or `"auto"`, *optional*, defaults to `"auto"`):
            Before the first step, the dataset's first packed rows through the model against each of their samples
            alone (`sft.run.packing_check`); a difference above the dtype's noise refuses packing with the figures.
            `auto`: for a model outside sft's architecture table (whose packing the suite does not check).
        fp8 (`bool` or `"auto"`, *optional*, defaults to `"auto"`):
            Train the decoder's linear layers in FP8 (torchao float8, see `sft.model.fp8`). `auto`: on only with a GPU
            that has FP8 tensor cores, torchao installed, no LoRA, and a model wide enough that FP8 measured faster.
        engine (`str`, *optional*, defaults to `"auto"`):
            What shards and steps the model: `deepspeed` (the `deepspeed` config; none: one replica per process),
            `fsdp2` (PyTorch's FSDP2 through accelerate's plugin, as transformers' `fsdp_config` with version 2 drives
            it: sft writes the config, each decoder layer a unit, sharded checkpoints; see `sft.engines.fsdp2`), or
            `auto`: DeepSpeed, except FSDP2 in place of a ZeRO-3 config where the plan's speed model estimates it
            faster (full fine-tuning on a GPU, no offload, sequence or expert parallelism; a resume keeps its
            checkpoint's engine; `sft.plan.preflight`).
        optim (`str`, *optional*, defaults to `"auto"`):
            transformers' optimizer name (`adamw_torch_fused`, `adamw_torch_8bit`, ...), or `auto`: fused AdamW with
            fp32 moments, or torchao's 8-bit AdamW (`adamw_torch_8bit`: Adam's moments in 8-bit blocks, a quarter of
            their memory) where the speed model finds the fastest setting that fits with them at least 10% faster
            (full fine-tuning under ZeRO with the optimizer on the GPU; its 300-step loss curve measured equal to fp32
            Adam's, benchmarks/results/fp8/call5_accuracy_adam8). A resumed run keeps its checkpoint's optimizer.
        fp8_recipe (`str`, *optional*, defaults to `"tensorwise"`):
            torchao's float8 scaling: `tensorwise` (one scale per tensor) or `rowwise` (one per row). Tensorwise
            measured faster on H200 (benchmarks/results/fp8: 1B 1.04x vs 0.86x, 3B 1.09x vs 0.96x of bf16).
        sequence_parallel_size (`int` or `"auto"`, *optional*, defaults to `1`):
            Processes that share the tokens of one packed row (Ulysses sequence parallelism on DeepSpeed, see
            `sft.parallel.sequence`); the data-parallel size is the world size / this. `auto`: the smallest size whose
            memory plan fits (1 without a GPU to plan for).
        expert_parallel_size (`int`, *optional*, defaults to `1`):
            Data-parallel processes that split each mixture-of-experts layer's experts (DeepSpeed AutoEP, see
            `sft.engines.deepspeed.autoep`): each keeps count / this of the experts and tokens travel to theirs by
            all-to-all. Must divide the data-parallel size; for the families AutoEP has a preset for, under ZeRO-0/1/2.
        report (`bool`, *optional*, defaults to `True`):
            At the end of training, write `<output_dir>/report/` (`sft.run.report`: one PNG per curve and an HTML
            page with them inline, the settings and totals). `sft report RUN_DIR` writes it for any run, several
            overlaid.
        max_nonfinite_steps (`int`, *optional*, defaults to `1`):
            Stop the run at the Nth optimizer step whose loss or gradient norm is NaN or infinite (`sft.run.failsafe`);
            the ones before it are skipped, not applied to the weights. 1: stop at the first.
        trace_data (`bool`, *optional*, defaults to `False`):
            Write one line per micro-batch and rank (step, token count, SHA-1 of the input ids) to
            `<output_dir>/data_trace/rank<R>.jsonl`, to audit how the data is sharded and ordered.
    """

    resume_from_checkpoint: str | None = field(
        default="auto",
        metadata={
            "help": "`auto` (newest complete checkpoint in output_dir, or a fresh start), a checkpoint, or `none`."
        },
    )
    sequence_parallel_size: str = field(
        default="1",
        metadata={"help": "Processes sharing one row's tokens (Ulysses SP on DeepSpeed), or `auto` (the plan's)."},
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={"help": "Processes that split each MoE layer's experts (DeepSpeed AutoEP); divides data parallel."},
    )
    report: bool = field(
        default=True,
        metadata={"help": "Write <output_dir>/report/ (curves as PNG + one HTML page) when training ends."},
    )
    max_nonfinite_steps: int = field(
        default=1,
        metadata={"help": "Stop at the Nth step whose loss or grad norm is not finite (those before are skipped)."},
    )
    trace_data: bool = field(
        default=False,
        metadata={"help": "Log a hash of every micro-batch per rank to `<output_dir>/data_trace/` (audits sharding)."},
    )
    train_vision_tower: bool = field(
        default=False,
        metadata={
            "help": "Vision-language models: train the vision encoder too (default: frozen; its projector and "
            "the language model train)."
        },
    )
    per_device_train_batch_size: str = field(
        default="auto",
        metadata={"help": "Rows per GPU per forward pass, or `auto` (the largest the memory plan fits)."},
    )
    activation_checkpointing: str | None = field(
        default="auto",
        metadata={
            "help": "Recompute activations in backward: true, false, or `auto` (only if the plan needs it).",
            "nargs": "?",
            "const": "true",
        },
    )
    offload_checkpoints: str = field(
        default="auto",
        metadata={"help": "Checkpointed layer inputs in CPU memory: true, false, or `auto` (if the plan needs it)."},
    )
    keep_attention_outputs: str = field(
        default="auto",
        metadata={"help": "With checkpointing, attention outputs kept, not recomputed: true, false, or `auto`."},
    )
    tiled_mlp: str = field(
        default="auto",
        metadata={"help": "The MLP in tiles along the row: true, false, or `auto` (only if the plan needs it)."},
    )
    fp8: str = field(
        default="auto",
        metadata={"help": "Decoder linears in FP8 (torchao float8): true, false, or `auto` (FP8 GPU, where faster)."},
    )
    engine: str = field(
        default="auto",
        metadata={"help": ENGINE_HELP},  # its choices are the engine registry's (`sft.plan.arguments.RunArguments`)
    )
    optim: str = field(
        default="auto",
        metadata={
            "help": "transformers' optimizer name, or `auto`: fused fp32 AdamW, or torchao's 8-bit AdamW where "
            "the plan finds it 1.1x as fast (full fine-tuning under ZeRO)."
        },  # fmt: skip
    )
    fp8_recipe: str = field(
        default="tensorwise",
        metadata={"help": "torchao float8 scaling of the FP8 layers.", "choices": list(FP8_RECIPES)},
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (TRL's default True is not applied)."},
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "Samples per optimizer step; sets gradient_accumulation_steps for any world size."},
    )
    tokens_per_step: int | None = field(
        default=None,
        metadata={"help": "Tokens per optimizer step with packing (rows x max_length); or use global_batch_size."},
    )
    plan_gpu_memory_gib: float | None = field(
        default=None, metadata={"help": "GPU memory to plan for, in GiB (default: this machine's GPU)."}
    )
    max_gpu_memory_gib: float | None = field(
        default=None,
        metadata={
            "help": "Cap each process's GPU memory at this many GiB (a shared GPU, or rehearsing a smaller one)."
        },
    )
    plan_headroom: float = field(default=0.1, metadata={"help": "Fraction of GPU memory the memory plan leaves free."})
    plan_check: bool = field(
        default=True, metadata={"help": "Refuse to start when the planned peak memory does not fit the GPU."}
    )
    use_liger_kernel: bool | None = field(
        default=None,
        metadata={"help": "Liger's Triton kernels; unset: on when a CUDA GPU and liger-kernel are present."},
    )
    compile_decoder_layers: str = field(
        default="auto",
        metadata={"help": "torch.compile each decoder layer: true, false, or `auto` (on with FP8)."},
    )
    packing_check: str = field(
        default="auto",
        metadata={"help": "Packed rows against their samples one by one before the first step: true, false, or "
                          "`auto` (for a model outside sft's architecture table)."},
    )  # fmt: skip
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "Peak TFLOP/s per GPU for MFU (default: the dense bf16 peak of the GPU found)."},
    )

    def __post_init__(self):
        self.auto_settings = set()  # fields left `auto`, resolved by sft.plan.preflight
        self._parse_sizes()
        self._parse_levers()
        if str(self.optim).strip().lower() == "auto":  # resolved by sft.plan.preflight (fp32 AdamW until then)
            self.auto_settings.add("optim")
            self.optim = DEFAULT_OPTIM
        self._check_numbers()
        if self.use_liger_kernel is None:  # `auto`: on for a family only where measured (sft.plan.preflight)
            self.auto_settings.add("use_liger_kernel")
            self.use_liger_kernel = liger_runs_here()
        elif self.use_liger_kernel and not cuda_here():
            logger.warning("`use_liger_kernel` needs a CUDA GPU (Triton kernels); turned off on this machine.")
            self.use_liger_kernel = False
        if not self.use_cpu and not torch.cuda.is_available():
            # Without this, accelerate sees no device backend and runs every rank as a world of one; with it, the
            # ranks of a torchrun/deepspeed launch on CPU form a gloo group (DeepSpeed ZeRO included).
            self.use_cpu = True
            logs.quiet_accelerator_detection()
        # sp must divide the launch's world size, ep its data-parallel size
        self.engine = str(self.engine).strip().lower()
        if self.engine == "auto":  # decided by the plan (`sft.plan.preflight`)
            self.auto_settings.add("engine")
        self._enter_engine(ParallelDims.from_env(self.sequence_parallel_size, self.expert_parallel_size))
        super().__post_init__()

    def _enter_engine(self, launch: ParallelDims) -> None:
        """Where the engine's configuration is written for a launch of `launch`, before transformers reads it: the
        run's arguments (`sft.plan.arguments.RunArguments`) do it through the engine registry; these parsed fields
        alone leave the engine's fields as given."""

    def _parse_sizes(self) -> None:
        """The micro batch and the parallel sizes: whole numbers, or `auto` (a placeholder until the plan chooses)."""
        micro = self.per_device_train_batch_size
        if isinstance(micro, str):
            if micro.strip().lower() == "auto":
                self.auto_settings.add("per_device_train_batch_size")
                micro = 1  # a placeholder until the plan chooses
            elif micro.strip().isdigit():
                micro = int(micro)
            else:
                raise ConfigError(
                    f"`per_device_train_batch_size` must be a positive integer or `auto`, got {micro!r}."
                )
        self.per_device_train_batch_size = micro
        sp = str(self.sequence_parallel_size).strip().lower()
        if sp == "auto":
            self.auto_settings.add("sequence_parallel_size")
            sp = "1"  # a placeholder until the plan chooses
        if not sp.isdigit() or int(sp) < 1:
            raise ConfigError(
                f"`sequence_parallel_size` must be a whole number >= 1 or `auto`, got {self.sequence_parallel_size!r}."
            )
        self.sequence_parallel_size = int(sp)
        ep = self.expert_parallel_size
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ConfigError(
                f"`expert_parallel_size` must be a whole number >= 1 (1: no expert parallelism), got "
                f"{self.expert_parallel_size!r}."
            )

    def _parse_levers(self) -> None:
        """The memory levers and fast paths: true, false or `auto`, and the combinations that contradict each other."""
        # `gradient_checkpointing` is the deprecated name of activation_checkpointing
        explicit = None if self.gradient_checkpointing is None else bool(self.gradient_checkpointing)
        for name in ("activation_checkpointing", "offload_checkpoints", "keep_attention_outputs", "tiled_mlp", "fp8",
                     "compile_decoder_layers", "packing_check"):  # fmt: skip
            setattr(self, name, self._switch(name, explicit if name == "activation_checkpointing" else None))
        if self.keep_attention_outputs and "keep_attention_outputs" not in self.auto_settings:
            if self.offload_checkpoints and "offload_checkpoints" not in self.auto_settings:
                raise ConfigError(
                    "`keep_attention_outputs: true` keeps attention outputs on the GPU beside checkpoints that "
                    "`offload_checkpoints: true` moves to the CPU: set one of them to false (or auto)."
                )
            if not self.activation_checkpointing and "activation_checkpointing" not in self.auto_settings:
                raise ConfigError(
                    "`keep_attention_outputs: true` chooses what activation checkpointing recomputes: set "
                    "activation_checkpointing: true (or auto), or keep_attention_outputs: false."
                )
        if self.offload_checkpoints:
            if "activation_checkpointing" in self.auto_settings:  # offloading the checkpoints implies taking them
                self.auto_settings.discard("activation_checkpointing")
                self.activation_checkpointing = True
            if not self.activation_checkpointing:
                raise ConfigError(
                    "`offload_checkpoints: true` offloads what activation checkpointing keeps: set "
                    "activation_checkpointing: true (or auto), or offload_checkpoints: false."
                )
            if torch.cuda.is_available():
                kwargs = self.activation_checkpointing_kwargs or {}
                self.activation_checkpointing_kwargs = {**kwargs, "offload": True}
            # without a GPU the checkpoints are in host memory already (and pinned memory needs a GPU)

    def _check_numbers(self) -> None:
        """Counts, sizes and fractions in their ranges, before any work."""
        if isinstance(self.max_nonfinite_steps, bool) or self.max_nonfinite_steps < 1:
            raise ConfigError(
                f"`max_nonfinite_steps` is {self.max_nonfinite_steps!r}: it is the count of non-finite steps at which "
                "the run stops (1: at the first one), so it must be an integer of at least 1."
            )
        if self.tiled_mlp and not self.max_length:
            raise ConfigError("`tiled_mlp: true` sizes tiles by `max_length`: set max_length, or tiled_mlp: false.")
        for name in (
            "global_batch_size",
            "tokens_per_step",
            "plan_gpu_memory_gib",
            "max_gpu_memory_gib",
            "peak_tflops",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"`{name}` must be > 0 (or unset), got {value}.")
        if not 0 <= self.plan_headroom < 1:
            raise ConfigError(f"`plan_headroom` must be a fraction in [0, 1), got {self.plan_headroom}.")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"`{name}` must be >= 1, got {value}.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(
                "`max_steps` must be a positive number of optimizer steps, or -1 to train for `num_train_epochs`, "
                f"got {self.max_steps}."
            )
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise ConfigError(
                f"`num_train_epochs` must be > 0 (or set `max_steps`), got {self.num_train_epochs}: nothing would "
                "train."
            )
        if self.learning_rate < 0:
            raise ConfigError(f"`learning_rate` must be >= 0, got {self.learning_rate}.")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"`max_length` must be >= 1 (or null for no limit), got {self.max_length}.")

    def _switch(self, name: str, explicit: bool | None) -> bool:
        """A true/false/`auto` field as a bool; `auto` recorded in `auto_settings` (False until the plan decides)."""
        value = getattr(self, name)
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text == "auto":
            if explicit is not None:
                return explicit
            self.auto_settings.add(name)
            return False
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ConfigError(f"`{name}` must be true, false or `auto`, got {value!r}.")

    @property
    def padding_free_batches(self) -> bool:
        """Batches are one flattened row whose samples are told apart by position_ids (TRL's padding-free path)."""
        return bool(self.padding_free or (self.packing and self.packing_strategy in {"bfd", "bfd_split"}))

    def with_values(self, keep_auto: bool = True, **values) -> TrainConfig:
        """These arguments with `values` set, parsed again (the engine's configuration written for them): how the plan
        emits the training arguments transformers reads. `keep_auto`: every field left `auto` stays `auto` (a choice
        made before the others, `engine: auto`'s), else the fields are what they now hold."""
        emitted = dataclasses.replace(self, **values)
        if keep_auto:
            emitted.auto_settings = set(self.auto_settings)
        return emitted

    @functools.cached_property
    def parallel(self) -> ParallelDims:
        """The run's parallel dimensions (`sft.core.dims`), built once from the processes accelerate found."""
        return ParallelDims.of(self)


def cuda_here() -> bool:
    """Whether this machine has a CUDA GPU, which Liger's Triton kernels need."""
    return torch.cuda.is_available()


def liger_runs_here() -> bool:
    """Whether Liger's Triton kernels can run on this machine (a CUDA GPU, liger-kernel installed): what
    `use_liger_kernel: auto` starts from before the plan's rule for the family (`sft.plan.kernels.liger_on`)."""
    return cuda_here() and importlib.util.find_spec("liger_kernel") is not None


# Flags from other trainers' command lines, named in the "did you mean" of an unknown flag
FLAG_SHORTHANDS = {
    "--lr": "--learning_rate", "--epochs": "--num_train_epochs", "--bs": "--per_device_train_batch_size",
    "--batch_size": "--per_device_train_batch_size", "--model": "--model_name_or_path", "--output": "--output_dir",
    "--seq_len": "--max_length", "--max_seq_length": "--max_length",
}  # fmt: skip


class _Parser(TrlParser):
    """TRL's parser without argparse's prefix matching (`--learning_rat` must not quietly become `--learning_rate`),
    whose errors (a bad value, a missing one) are sft's one-paragraph errors instead of argparse's usage dump."""

    def __init__(self, dataclass_types):
        super().__init__(dataclass_types, allow_abbrev=False)

    def error(self, message: str):
        raise ConfigError(f"{message}. See `python sft/train.py --help` for the fields.")


def make_parser(train: type = TrainConfig) -> TrlParser:
    """The parser of a recipe's dataclasses, `train` for the training arguments (`TrainConfig`, or the run's
    `sft.plan.arguments.RunArguments`, which enters the engine)."""
    return _Parser((ScriptArguments, DataArguments, train, ModelArguments))


# The fields people set most, grouped, for `--help` (a line of sft's where the library's help is vague);
# `--help-all` prints every field with argparse's full help
HELP_GROUPS = {
    "model": {
        "model_name_or_path": "hub id or local directory of the model (and its tokenizer)",
        "from_scratch": "random weights from model_name_or_path/config.json (the demo)",
        "dtype": "dtype the weights load in (bfloat16 on GPUs; the demo float32)",
        "attn_implementation": "auto: varlen FlashAttention-2 on GPUs, sdpa on CPU; or a backend name",
        "use_peft": "train LoRA adapters instead of all weights",
        "lora_r": "LoRA rank",
        "load_in_4bit": "QLoRA: the base in 4-bit NF4 (needs use_peft and bitsandbytes)",
    },
    "data (the lists of sources are recipe keys)": {
        "datasets": "training sources: a list of {path, name, split, columns, fraction}",
        "eval_datasets": None,
        "max_length": "tokens per row (packed rows are filled up to it)",
        "packing": "pack samples into rows of max_length, padding-free",
        "assistant_only_loss": "loss on the assistant turns only",
    },
    "batch and memory": {
        "global_batch_size": "rows per optimizer step on any GPU count (sets accumulation)",
        "tokens_per_step": "the same as a token count (rows x max_length)",
        "per_device_train_batch_size": "rows per GPU per forward pass; auto: the largest that fits",
        "activation_checkpointing": "true, false, or auto: only if the memory plan needs it",
        "sequence_parallel_size": "GPUs sharing each row (long context); auto: the smallest that fits",
        "expert_parallel_size": "GPUs splitting each MoE layer's experts (DeepSpeed AutoEP)",
        "plan_gpu_memory_gib": None,
        "max_gpu_memory_gib": "cap each process's GPU memory (rehearse a smaller GPU)",
    },
    "optimizer and schedule": {
        "learning_rate": "peak learning rate",
        "optim": "auto: fp32 AdamW, or 8-bit AdamW (torchao) where the plan finds it 1.1x as fast",
        "lr_scheduler_type": None,
        "warmup_steps": "steps of linear warm-up (or a fraction of the run if < 1)",
        "weight_decay": None,
        "num_train_epochs": None,
        "max_steps": "stop after this many optimizer steps (overrides num_train_epochs)",
    },
    "DeepSpeed and precision": {
        "engine": "auto (DeepSpeed, or FSDP2 for a ZeRO-3 run where estimated faster), deepspeed or fsdp2",
        "deepspeed": "a DeepSpeed config (ds_configs/zero2.json, zero3.json, *_offload.json) or none",
        "bf16": "bf16 mixed precision (on GPUs)",
        "fp8": "FP8 linears (torchao): true, false, or auto (H100/H200, where faster)",
    },
    "output and resume": {
        "output_dir": "where the model, checkpoints and metrics.jsonl go (never overwritten)",
        "resume_from_checkpoint": "auto: newest complete checkpoint in output_dir; a path; or none",
        "save_steps": "save a checkpoint every N steps",
        "save_total_limit": "keep this many checkpoints",
    },
    "logging and evaluation": {
        "logging_steps": "log every N steps (metrics.jsonl, tensorboard, wandb)",
        "max_nonfinite_steps": "stop at the Nth step whose loss or gradient norm is NaN/inf (1); earlier ones skipped",
        "report": "curves as PNGs + an HTML page in <output_dir>/report/ at the end (true)",
        "report_to": "none, tensorboard, wandb (WANDB_MODE=offline without network)",
        "eval_strategy": "no, steps or epoch",
        "seed": "seed of the weights (from_scratch), data order and dropout",
    },
}

USAGE = """usage: python sft/train.py --config RECIPE.yaml [--FIELD VALUE ...]
       torchrun --nproc_per_node N sft/train.py --config ...      sft train --nproc-per-node N --config ...

Fine-tune a causal LM from a YAML recipe (e.g. recipes/demo.yaml). Every recipe field is also a flag, and a flag
overrides the recipe: --learning_rate 1e-5, --deepspeed ds_configs/zero3.json (or none), --output_dir outputs/x.
`sft train` starts the worker processes itself with torchrun's flags --nproc-per-node N (--nnodes, --node-rank,
--master-addr, --master-port, --max-restarts)."""


def _first_sentence(text: str, width: int = 72) -> str:
    text = " ".join((text or "").split())
    cut = text.find(". ")
    text = (text if cut < 0 else text[:cut]).rstrip(".")
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def short_help(parser: TrlParser) -> str:
    """`--help`: usage with `--config`, then the most used fields by group, each with one line and its default."""
    actions = {action.dest: action for action in parser._actions if action.dest != "help"}
    lines = [USAGE, ""]
    for group, fields in HELP_GROUPS.items():
        lines.append(f"{group}:")
        for name, line in fields.items():
            action = actions[name]
            value = parser.get_default(name)  # the field's own action's (a bool's `--no_x` twin defaults False)
            default = "" if value in (None, [], "") else f" [{value}]"
            lines.append(f"  --{name:<28} {line or _first_sentence(action.help)}{default}")
        lines.append("")
    lines.append(f"{len(actions)} fields in all: `--help-all` lists every one (TRL's, transformers' and sft's).")
    return "\n".join(lines)


def _check_flags(parser: TrlParser, args: list[str]) -> None:
    """An unknown command-line flag is one paragraph naming the closest real ones, not argparse's usage dump."""
    known = {option for action in parser._actions for option in action.option_strings} | {"--config"}
    named = sorted(option for option in known if "-" not in option[2:] and option != "--help")  # fields, not twins
    for arg in args:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or flag in known or flag == "--":
            continue
        hints = [FLAG_SHORTHANDS[flag]] if flag in FLAG_SHORTHANDS else []
        hints += [h for h in difflib.get_close_matches(flag, named, n=3, cutoff=0.6) if h not in hints]
        hints = hints[:3]
        if not hints:  # a short or partial name: the flags that contain it
            hints = [option for option in named if flag[2:] in option][:3]
        fix = f"did you mean {' or '.join(f'`{h}`' for h in hints)}?" if hints else "no flag is close to it."
        raise ConfigError(f"unknown flag `{flag}`: {fix} Every field of `python sft/train.py --help` is a flag.")


SOURCE_KEYS = [f.name for f in dataclasses.fields(DatasetConfig)]


def _check_sources(path: Path, key: str, value) -> None:
    """`datasets` / `eval_datasets`: a list of mappings with a `path` and only DatasetConfig's keys."""
    example = f"{key}:\n  - path: data/train.jsonl"
    if not isinstance(value, list):
        raise ConfigError(
            f"{path}: `{key}` must be a list of sources, got {type(value).__name__} {value!r}. Write it as\n{example}"
        )
    for i, source in enumerate(value):
        if not isinstance(source, dict):
            raise ConfigError(f"{path}: `{key}[{i}]` must be a mapping with a `path`, got {source!r}. E.g.\n{example}")
        for name in source:
            if name not in SOURCE_KEYS:
                hint = difflib.get_close_matches(str(name), SOURCE_KEYS, n=1)
                fix = f"did you mean `{hint[0]}`?" if hint else f"a source has {', '.join(SOURCE_KEYS)}."
                raise ConfigError(f"{path}: `{key}[{i}]` has an unknown key `{name}` (value {source[name]!r}); {fix}")
        if not source.get("path"):
            raise ConfigError(f"{path}: `{key}[{i}]` has no `path` (a file, directory or hub id): {source!r}.")
        if not source.get("data_files") and missing_local_source(str(source["path"])):
            raise ConfigError(
                f"{path}: `{key}[{i}].path` is {source['path']!r}, which does not exist (relative paths are read from "
                f"{os.getcwd()}). Fix the path, or give a hub id (org/name)."
            )


def _number_kind(kind) -> type | None:
    """int or float for a number field's parser type, also where TRL's parser wraps it to accept "none"."""
    if kind in (int, float):
        return kind
    inner = [cell.cell_contents for cell in getattr(kind, "__closure__", None) or ()]
    return next((k for k in inner if k in (int, float)), None)


def _check_value(field: str, value, kind, where: str) -> None:
    """A number field's value: a whole number for int fields, a finite number for float ones (strings that argparse
    will convert are checked as converted)."""
    kind = _number_kind(kind)
    if value is None or kind is None:
        return
    converted = value
    if isinstance(value, str):
        try:
            converted = kind(value)
        except ValueError:
            converted = None
    bad = isinstance(converted, bool) or not isinstance(converted, (int, float))
    if kind is int and isinstance(converted, float):
        bad = True
    if not bad and not math.isfinite(converted):
        bad = True
    if bad:
        wanted = "a whole number" if kind is int else "a finite number"
        raise ConfigError(f"{where}`{field}` must be {wanted}, got {value!r}.")


def _check_recipe(parser: TrlParser, args: list[str]) -> None:
    """Reject a missing or malformed recipe, a key given twice, a key no dataclass knows, malformed data sources and
    number fields of the wrong kind, before TrlParser turns them into flags."""
    path = recipe_path(args)
    if path is None:
        return
    recipe = read_recipe(path)
    actions = {action.dest: action for action in parser._actions}
    known = set(actions) | {"env"}
    for key, value in recipe.items():
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            fix = f"did you mean `{hint[0]}`?" if hint else "remove it, or see `python sft/train.py --help`."
            raise ConfigError(f"{path}: unknown key `{key}` (value {value!r}); {fix}")
        if key in ("datasets", "eval_datasets"):
            _check_sources(path, key, value)
        elif key != "env":
            _check_value(key, value, actions[key].type, f"{path}: ")


def _name_the_field(message: str, parser: TrlParser, args: list[str]) -> str:
    """transformers' value errors ("cosin is not a valid SchedulerType") with the field whose value they quote."""
    given = dict(read_recipe_in(args) or {})
    for flag, value in zip(args, args[1:], strict=False):
        if flag.startswith("--") and flag != "--config":
            given[flag[2:]] = value
    for key, value in given.items():
        text = str(value)
        if isinstance(value, (str, int, float)) and len(text) > 1 and re.search(rf"\b{re.escape(text)}\b", message):
            return f"`{key}: {text}`: {message}"
    return f"invalid configuration: {message}"


def _check_parsed_values(*arguments) -> None:
    """After parsing, what only the parsed values show: non-finite numbers from the command line, the dtype."""
    for args in arguments:
        for f in dataclasses.fields(args):
            value = getattr(args, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"`{f.name}` must be a finite number, got {value}.")
    model_args = arguments[-1]
    dtype = model_args.dtype
    if dtype not in (None, "auto") and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise ConfigError(f"`dtype` is {dtype!r}, not a torch dtype: use bfloat16, float16, float32 or auto.")


def parse_args(
    args: list[str] | None = None, train: type = TrainConfig
) -> tuple[ScriptArguments, DataArguments, TrainConfig, ModelArguments]:
    """Parse a recipe plus CLI overrides into sft's dataclasses (`train` for the training arguments: a run's come from
    `sft.plan.arguments.parse_args`, with the engine entered); raise ConfigError on anything invalid."""
    import sys

    args = with_config(sys.argv[1:] if args is None else args, "sft train")
    parser = make_parser(train)
    if "-h" in args or "--help" in args or "--help-all" in args:
        print(parser.format_help() if "--help-all" in args else short_help(parser))
        raise SystemExit(0)
    _check_flags(parser, args)
    _check_recipe(parser, args)
    try:
        script_args, data_args, training_args, model_args = parser.parse_args_and_config(args)
    except ConfigError:
        raise
    except (ValueError, TypeError, AttributeError) as e:  # transformers/TRL rejecting a value in __post_init__
        raise ConfigError(_name_the_field(str(e), parser, args)) from e
    _check_parsed_values(script_args, data_args, training_args, model_args)
    if not data_args.datasets and not script_args.dataset_name:
        raise ConfigError("No training data: set `datasets` (a list of sources) or `dataset_name` in the recipe.")
    strategy = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy))
    has_eval = data_args.eval_datasets or data_args.test_split_size is not None or script_args.dataset_name
    if strategy != "no" and not has_eval:
        raise ConfigError(
            f"`eval_strategy: {strategy}` "
            "evaluates during training, but there is no eval set: add `eval_datasets` (or `test_split_size`), or set "
            "eval_strategy: no."
        )
    if not model_args.model_name_or_path:
        raise ConfigError("`model_name_or_path` is not set: give a hub id or a local model directory.")
    if model_args.from_scratch and model_args.use_peft:
        raise ConfigError(
            "`use_peft` trains LoRA adapters on a base model's weights, but `from_scratch` makes random base weights "
            "that are never saved, so the adapter could not be used or merged. Train the base first (e.g. the demo), "
            "then point `model_name_or_path` at its output with `from_scratch: false`."
        )
    if model_args.use_peft and model_args.lora_target_parameters and model_args.lora_dropout:
        raise ConfigError(
            f"`lora_target_parameters: {model_args.lora_target_parameters}` with `lora_dropout: "
            f"{model_args.lora_dropout}`: PEFT's adapters on parameters (a MoE's experts) add B @ A to the weight "
            "itself, so no dropout can apply to their input. Set `lora_dropout: 0`."
        )
    if model_args.from_scratch and not os.path.isfile(os.path.join(model_args.model_name_or_path, "config.json")):
        raise ConfigError(
            f"`from_scratch` builds the model from {model_args.model_name_or_path}/config.json, which does not exist."
        )
    return script_args, data_args, training_args, model_args
