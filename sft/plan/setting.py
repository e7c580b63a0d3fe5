"""A training setting as the plan sizes it (`Setting`: the engine's layout, the processes, the micro batch and row,
the memory levers, the kernels, the method and the optimizer's states), and how a run's fields become one
(`setting_of`, from `SETTING_FIELDS` under the recipe's names). The memory a setting takes is `sft.plan.memory`'s, its
speed `sft.plan.speed`'s, the search over settings `sft.plan.fits`' and `sft.plan.search`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from sft import engines
from sft.core.engine import Sharding
from sft.plan.levers import Tools


@dataclass(frozen=True)
class Setting:
    """One training setting to size. `zero_stage` None means no DeepSpeed (plain DDP)."""

    gpus: int = 1  # processes in all (nodes x GPUs per node): ZeRO shards over every one of them
    gpus_per_node: int | None = None  # defaults to gpus (one node)
    zero_stage: int | None = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    micro_batch: int = 1
    seq_len: int = 2048  # tokens per row: max_length (with packing every row is full)
    activation_checkpointing: bool = False
    liger: bool = False
    lora_r: int = 0  # 0: full fine-tuning
    lora_dropout: float = 0.0
    qlora: bool = False
    qlora_nested: bool = False  # `use_bnb_nested_quant`: the quantization constants quantised again (8-bit)
    dtype_bytes: int = 2  # bf16/fp16 mixed precision: 2; fp32: 4
    sp: int = 1  # sequence-parallel ranks sharing each row (Ulysses): each GPU holds seq_len / sp of its tokens
    ep: int = 1  # expert parallelism (AutoEP): each GPU holds 1/ep of the routed experts
    offload_checkpoints: bool = False  # what checkpointing keeps (each layer's input) in pinned CPU memory
    tiled_mlp: bool = False  # each MLP computed in tiles of about `hidden` tokens (DeepSpeed's TiledMLP)
    fp8: bool = False  # the decoder's linear layers in torchao float8 (`sft.model.fp8`)
    accumulation: int = 1  # micro-batches per optimizer step (gradient_accumulation_steps)
    # with offload_optimizer under ZeRO-3: the share of the optimizer states (whole sub-groups) on the CPU, the rest
    # stepped on the GPU (DeepSpeed's `offload_optimizer.ratio`)
    offload_ratio: float = 1.0
    # with checkpointing: the attention kernels' outputs kept (`sft.model.checkpointing`)
    keep_attention_outputs: bool = False
    compiled: bool = False  # compiled decoder layers (the speed model's; no memory of their own)
    # Adam's two moments per trained parameter: fp32 (8 bytes), or 8-bit blocks (`optim: adamw_torch_8bit`, torchao's
    # AdamW8bit: a byte each plus a fp32 scale per 256; `moment_bytes_of`)
    moment_bytes: float = 8.0
    # the engine that shards, by its name in `sft.engines.SPECS` (read through `traits`: FSDP2 has none of ZeRO-3's
    # per-layer host hooks, the speed model's `zero3_host_s_per_layer_pass`); memory is planned with ZeRO's terms for
    # the engine's layout
    engine: str = engines.NAMES[0]
    # an fp32 master copy of the trained weights: kept by every engine that shards (ZeRO, FSDP2's fp32 parameters);
    # without one, bf16 weights are stepped in place (`sft.plan.preflight._precision`: stochastic rounding)
    master_weights: bool = True

    @property
    def state_bytes(self) -> float:
        """Optimizer state per trained parameter: the fp32 master weight and Adam's moments (fp32 where the optimizer
        is offloaded: DeepSpeed's CPU Adam steps it then, whatever `optim` says)."""
        if self.offload_optimizer:
            return 12.0
        return (4 if self.master_weights else 0) + self.moment_bytes

    @property
    def eight_bit_moments(self) -> bool:
        """Adam's moments in 8-bit blocks on the GPU (torchao's AdamW8bit)."""
        return not self.offload_optimizer and self.moment_bytes < 4

    @property
    def tokens(self) -> int:
        """Tokens one GPU holds activations for: its slice of each row."""
        return self.micro_batch * -(-self.seq_len // self.sp)

    @functools.cached_property  # read about a million times by a speed fit: made once per setting
    def sharding(self) -> Sharding:
        """What this setting shards and offloads (`sft.core.engine.Sharding`): every test of the layout reads it."""
        return Sharding(self.zero_stage, self.offload_optimizer, self.offload_params, self.offload_ratio)

    @functools.cached_property
    def traits(self) -> engines.Traits:
        """The declared traits of the engine this setting runs under (`sft.engines.SPECS`)."""
        return engines.spec(self.engine).traits

    def describe(self) -> str:
        zero = self.sharding.label
        if self.traits.shards_weights_always:  # planned with ZeRO's terms for the same layout
            layout = "resharded" if self.sharding.weights else "kept gathered"
            zero = f"{self.traits.label} ({layout}: {self.sharding.label}'s layout)"
        if self.offload_optimizer or self.offload_params:
            optimizer = "optimizer" + (f" ({self.ratio:.0%})" if self.ratio < 1 else "")
            zero += " + offload " + "+".join(
                n for n, on in ((optimizer, self.offload_optimizer), ("params", self.offload_params)) if on
            )
        method = "full" if not self.lora_r else f"{'QLoRA' if self.qlora else 'LoRA'} r={self.lora_r}"
        ckpt, liger = ("on" if flag else "off" for flag in (self.activation_checkpointing, self.liger))
        sp = f", sequence-parallel {self.sp}" if self.sp > 1 else ""
        sp += f", experts split {self.ep} ways" if self.ep > 1 else ""
        tools = "".join(
            f", {name}"
            for name, on in (
                ("offloaded to CPU", self.offload_checkpoints),
                ("attention kept", self.keep_attention_outputs),
                ("tiled MLP", self.tiled_mlp),
            )  # fmt: skip
            if on
        )
        return (
            f"{zero}, {self.gpus} GPU(s){sp}, micro batch {self.micro_batch} x {self.seq_len} tokens, activation "
            f"checkpointing {ckpt}{tools}, Liger {liger}, {method}{', FP8' if self.fp8 else ''}"
            f"{', 8-bit Adam moments' if self.eight_bit_moments else ''}"
        )

    def levers_and_micro(self) -> str:
        """The micro batch, the accumulation and the levers, in a few words (the speed model's ranking)."""
        levers = ", ".join(self.tools.names()) or "no memory lever"
        dtype = "bf16" if self.dtype_bytes == 2 else "fp32"
        kernels = "FP8 compiled" if self.fp8 else f"{dtype} compiled" if self.compiled else dtype
        kernels += ", Liger" if self.liger else ""
        moments = ", 8-bit Adam" if self.eight_bit_moments else ""
        return f"micro batch {self.micro_batch} x {self.accumulation} accumulation, {levers}, {kernels}{moments}"

    def attention_kept_eager(self, fp8_auto: bool = True) -> Setting:
        """As a run sets it with attention outputs kept: layers not compiled (the selection of what to keep does not
        reach inside a compiled layer), and FP8 off with them where `fp8_auto` (float8 is fast only compiled;
        `sft.plan.kernels.keep_attention_eager`)."""
        if not (self.keep_attention_outputs and self.compiled):
            return self
        return dataclasses.replace(self, compiled=False, fp8=self.fp8 and not fp8_auto)

    def stepped_in_place(self) -> Setting:
        """As a run without a sharding engine steps bf16 weights: no fp32 master copy, a torch optimizer's moments in
        the weights' dtype (8-bit ones stay 8-bit)."""
        moments = self.moment_bytes if self.moment_bytes < 8 else 2 * self.dtype_bytes
        return dataclasses.replace(self, master_weights=False, moment_bytes=moments)

    def with_master_copy(self) -> Setting:
        """As DeepSpeed steps it: an fp32 master copy, and fp32 moments where a torch optimizer kept 16-bit ones."""
        if self.master_weights:
            return self
        moments = 8.0 if self.moment_bytes >= 4 else self.moment_bytes
        return dataclasses.replace(self, master_weights=True, moment_bytes=moments)

    def with_tools(self, tools: Tools, ratio: float = 1.0) -> Setting:
        """This setting with every lever as `tools` sets it (a lever's `Setting` field is its name), and the optimizer
        offload's share `ratio` where only the optimizer is offloaded."""
        return dataclasses.replace(self, **tools._asdict(), offload_ratio=ratio if tools.offload_optimizer and not
                                   tools.offload_params else 1.0)  # fmt: skip

    @property
    def tools(self) -> Tools:
        return Tools(*(getattr(self, name) for name in Tools._fields))

    @property
    def ratio(self) -> float:
        """The share of the optimizer states on the CPU: `offload_ratio` under ZeRO-3 optimizer offload, else all or
        nothing."""
        if not self.offload_optimizer:
            return 0.0
        return self.offload_ratio if self.sharding.weights and not self.offload_params else 1.0


# `optim` values whose Adam moments are 8-bit blocks, bytes per parameter for both (torchao's AdamW8bit: a uint8 code
# each plus a fp32 scale per block of 256; under ZeRO it quantizes each flat partition of 4,096 elements or more whose
# size is a multiple of 256, and keeps the small ones in fp32)
EIGHT_BIT_MOMENTS = {"adamw_torch_8bit": 2 + 8 / 256}


# The recipe fields (`TrainConfig`'s and `ModelArguments`' names) a `Setting` is made of (`setting_of`)
SETTING_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_length",
    "activation_checkpointing",
    "offload_checkpoints",
    "tiled_mlp",
    "keep_attention_outputs",
    "use_liger_kernel",
    "use_peft",
    "lora_r",
    "lora_dropout",
    "load_in_4bit",
    "use_bnb_nested_quant",
    "bf16",
    "fp16",
    "fp8",
    "compile_decoder_layers",
    "optim",
)


def setting_of(fields, layout, engine: str, gpus: int, gpus_per_node: int | None = None, sp: int = 1,
               ep: int = 1) -> Setting:  # fmt: skip
    """The setting a run asks for: `fields` {recipe field: value} (`SETTING_FIELDS`: `sft train` hands its training
    and model arguments, `sft plan` its flags under the same names), under `engine` in its `layout`
    (`sft.core.engine.Sharding`) on `gpus` processes. The one place a recipe's lever becomes the plan's: a new lever is
    a field here and a flag of `sft plan`."""
    peft = bool(fields.get("use_peft"))
    four_bit = peft and bool(fields.get("load_in_4bit"))
    return Setting(
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        zero_stage=layout.stage,
        offload_optimizer=layout.offload_optimizer,
        offload_params=layout.offload_params,
        offload_ratio=layout.offload_ratio,
        micro_batch=fields["per_device_train_batch_size"],
        accumulation=fields.get("gradient_accumulation_steps") or 1,
        seq_len=fields.get("max_length") or 0,
        activation_checkpointing=bool(fields.get("activation_checkpointing")),
        offload_checkpoints=bool(fields.get("offload_checkpoints")),
        tiled_mlp=bool(fields.get("tiled_mlp")),
        keep_attention_outputs=bool(fields.get("keep_attention_outputs")),
        liger=bool(fields.get("use_liger_kernel")),
        lora_r=fields.get("lora_r") or 0 if peft else 0,
        lora_dropout=fields.get("lora_dropout") or 0.0 if peft else 0.0,
        qlora=four_bit,
        qlora_nested=four_bit and bool(fields.get("use_bnb_nested_quant")),
        dtype_bytes=2 if (fields.get("bf16") or fields.get("fp16")) else 4,
        sp=sp,
        ep=ep,
        fp8=bool(fields.get("fp8")),
        compiled=bool(fields.get("compile_decoder_layers")),
        moment_bytes=moment_bytes_of(fields.get("optim")),
        engine=engine,
    )


def moment_bytes_of(optim) -> float:
    """Bytes of Adam's two moments per parameter for the optimizer `optim` (transformers' `optim` name or enum)."""
    return EIGHT_BIT_MOMENTS.get(str(getattr(optim, "value", optim) or "").lower(), 8.0)
