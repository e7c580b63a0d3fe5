"""FP8 training: torchao's float8 linear layers on the decoder, where the GPU has FP8 tensor cores and it pays.

`fp8: auto | true | false` (recipe field, `auto` by default) is resolved here, once, before the model is built:

- `true` converts the decoder's linear layers to torchao `Float8Linear` (dynamic scaling: the scales are computed
  from each tensor in every step, so there is no scale state to save or restore on a resume). Not converted: the LM
  head and the embeddings (outside the decoder layers), and any layer that torchao's own size filter says would not
  gain (`torchao.float8._auto_filter_for_recipe`: both dims multiples of 16, plus the recipe's thresholds measured on
  H100; e.g. rowwise skips N <= 2048 or K <= 1024). Under ZeRO-3 the filter reads the full shape of a partitioned
  weight (`ds_shape`); DeepSpeed gathers the weight before the float8 cast in every forward and backward.
- `fp8_recipe` picks torchao's scaling: `tensorwise` (one scale per tensor) or `rowwise` (one per row).
- `auto` is on only with a GPU of compute capability >= 8.9 (Hopper, Ada: FP8 tensor cores), torchao installed, no
  LoRA, and a model at least `AUTO_MIN_HIDDEN` wide, the smallest width where `benchmarks/fp8.py` measured FP8 faster
  than bf16 (`benchmarks/results/fp8/`). The choice and its reason are logged at start.
- Under ZeRO-3, `auto` stays off: measured on the Llama-3.1-8B shape on 2 x H200 (`benchmarks/results/fp8/
  call4_8b_2gpu`), FP8 with compiled decoder layers ran at 0.875x of bf16 under ZeRO-3 (1.16x under ZeRO-2).
  `fp8: true` under ZeRO-3 runs (compiled, ZeRO-3's hooks eager between the compiled pieces) with that figure logged.
- Under FSDP2 (`engine: fsdp2`) `auto` is on as without sharding: torchao's own `Float8Linear`, whose weights FSDP2
  all-gathers in float8 (tensorwise: a byte a weight, each shard cast with the whole weight's scale, the scales
  precomputed after each optimizer step), measured 1.13x bf16 on the Llama-3.1-8B widths on 2 x H200 at micro batch 2
  (`benchmarks/results/fsdp2_h200x4`); the speed model still weighs FP8 against bf16 for what fits.
- LoRA/QLoRA with FP8 is refused: the frozen base would be re-cast every step for adapters that hold the gradients,
  and that was never measured.

Packed micro-batches are padded to a multiple of `TOKEN_MULTIPLE` tokens (see there). FP8 needs `torch.compile` for
its speed (the casts and scales are separate kernels otherwise): with FP8 on, the decoder layers are compiled
(`compile_decoder_layers: auto`). MFU stays reported against the dense bf16 peak, so figures compare across runs;
with FP8 the matmuls can run up to twice that rate.

Without any GPU `fp8: true` is refused too, unless `SFT_FP8_ON_CPU=1` is set, which the tests use to check the
conversion, ZeRO-2/3 and resume without a GPU: the float8 casts and scales as on a GPU, the matmuls in torchao's
emulation (`emulate`: the float8 operands multiplied in high precision). torch's own CPU `_scaled_mm` took 54 s for
one step of two small linears on a CPU with AMX (Xeon, 2026-11-26), against 0.06 s emulated.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from typing import NamedTuple

import torch

from sft.errors import ConfigError
from sft.model import architectures

AUTO_MIN_HIDDEN = 2048  # `auto`: the smallest hidden size where FP8 measured faster (benchmarks/results/fp8/)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
CPU_ENV = "SFT_FP8_ON_CPU"
# float8 matmuls need each dimension a multiple of 16, the tokens of a micro-batch too (the inner dimension of the
# weight-gradient matmul): packed rows are padded to it (TRL's `pad_to_multiple_of`; under sequence parallelism each
# rank's share, by `sft.parallel.sequence`; tiles of the tiled MLP, by `sft.model.tiling`). The padding tokens are
# samples of one token with no loss; at most 15 per micro-batch, they are counted in TRL's `num_tokens`.
TOKEN_MULTIPLE = 16


def token_multiple(on: bool) -> int:
    """What a micro-batch's token count (a rank's share under SP, a tile of the tiled MLP) must be a multiple of."""
    return TOKEN_MULTIPLE if on else 1


# Measured (benchmarks/results/fp8/call4_8b_2gpu, Llama-3.1-8B shape, 2 x H200, same data and global batch):
ZERO3_SLOWER = (
    "FP8 under ZeRO-3 measured slower than bf16 (0.875x on the Llama-3.1-8B shape, 2 x H200; 1.16x under ZeRO-2): "
    "ZeRO-3 gathers each weight in 16 bits before the float8 cast, and its hooks split the compiled layers; on the "
    "Llama-3.2-3B shape on 1 x H200 it failed twice out of two with a CUDA illegal memory access in a compiled kernel "
    "(benchmarks/results/zero3_levers). Kept as asked; fp8: auto (or false) trains in bf16 here."
)


# `auto` under FSDP2, with the weights all-gathered in float8 (benchmarks/results/fsdp2_h200x4, call 2)
FSDP2_MEASURED = "under FSDP2 1.13x bf16 measured (Llama-3.1-8B widths, 2 x H200, micro batch 2, gathered in float8)"


class Decision(NamedTuple):
    on: bool
    reason: str


def torchao_installed() -> bool:
    """Whether torchao can be imported here (float8 training and its 8-bit AdamW need it; an optional dependency)."""
    return importlib.util.find_spec("torchao") is not None


def fp8_gpu() -> str | None:
    """The name of this machine's GPU when it has FP8 tensor cores, else None."""
    if not torch.cuda.is_available():
        return None
    if torch.cuda.get_device_capability() < MIN_CAPABILITY:
        return None
    return torch.cuda.get_device_name()


def resolve(
    value: bool, is_auto: bool, hidden_size: int, use_peft: bool, under_zero3: bool = False, fsdp2: bool = False
) -> Decision:
    """Whether this run trains in FP8, and why: `fp8: true` refused where it cannot run, `auto` decided."""
    gpu = fp8_gpu()
    on_cpu = not torch.cuda.is_available() and os.environ.get(CPU_ENV) == "1"
    has_torchao = torchao_installed()
    if not is_auto:
        if not value:
            return Decision(False, "fp8: false")
        if use_peft:
            raise ConfigError(
                "`fp8: true` with `use_peft`: FP8 is not supported with LoRA/QLoRA (the frozen base would be cast "
                "every step for adapters that hold the gradients; unmeasured). Set fp8: false (or auto)."
            )
        if gpu is None and not on_cpu:
            found = "no GPU"
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                found = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"
            raise ConfigError(
                "`fp8: true` needs a GPU with FP8 tensor cores (compute capability >= 8.9: H100/H200, L40S, RTX "
                f"4090); this machine has {found}. Set fp8: false (or auto)."
            )
        if not has_torchao:
            raise ConfigError("`fp8: true` needs torchao: `pip install torchao` (or `pip install -e .[fp8]`).")
        return Decision(True, "fp8: true" + (f" ({CPU_ENV}=1: float8 matmuls on the CPU)" if on_cpu else ""))
    return decide_auto(gpu, has_torchao, hidden_size, use_peft, under_zero3, fsdp2)


def decide_auto(
    gpu: str | None,
    has_torchao: bool,
    hidden_size: int,
    use_peft: bool,
    under_zero3: bool = False,
    fsdp2: bool = False,
) -> Decision:
    """`fp8: auto` for a run on `gpu` (a GPU with FP8 tensor cores, or None) with or without torchao: this machine's
    (`resolve`) or the one `sft plan` plans for."""
    if gpu is None:
        return Decision(False, "no GPU with FP8 tensor cores")
    if use_peft:
        return Decision(False, "LoRA/QLoRA trains in bf16")
    if under_zero3:
        return Decision(False, "under ZeRO-3 FP8 measured slower than bf16 (0.875x, Llama-3.1-8B shape on 2 x H200)")
    if not has_torchao:
        return Decision(False, f"{gpu} has FP8 tensor cores but torchao is not installed (`pip install torchao`)")
    if hidden_size < AUTO_MIN_HIDDEN:
        return Decision(False, f"hidden size {hidden_size} < {AUTO_MIN_HIDDEN}, where FP8 measured no faster")
    under = f"; {FSDP2_MEASURED}" if fsdp2 else ""
    return Decision(True, f"{gpu} has FP8 tensor cores, hidden size {hidden_size} >= {AUTO_MIN_HIDDEN}{under}")


def layer_filter(recipe: str | None, decoder: tuple[str, ...] = ()):
    """torchao's size filter for `recipe`, applied only to the linears inside the decoder layers (`decoder`: their
    qualified-name prefixes, from `sft.model.architectures.decoder_prefixes`), on the weight's full shape (ZeRO-3
    partitions it: `ds_shape`). `recipe=None`: only both dims multiples of 16 (what the float8 matmul needs)."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    if recipe is None:

        def torchao_filter(module, fqn):
            return module.in_features % TOKEN_MULTIPLE == 0 and module.out_features % TOKEN_MULTIPLE == 0
    else:
        torchao_filter = _auto_filter_for_recipe(recipe, filter_fqns=[])

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or not fqn.startswith(decoder):
            return False
        out_features, in_features = getattr(module.weight, "ds_shape", module.weight.shape)
        with torch.device("meta"):
            probe = torch.nn.Linear(in_features, out_features, bias=False)
        return torchao_filter(probe, fqn)

    return keep


def all_gathers_float8(recipe: str) -> bool:
    """Whether FSDP2 all-gathers this recipe's weights in float8 (torchao: tensorwise scaling only)."""
    return recipe == "tensorwise"


def convert(
    model: torch.nn.Module, recipe: str, size_filter: bool = True, fsdp2: bool = False, fp32_master: bool = False
) -> int:
    """Swap the decoder's qualifying linear layers for float8 ones in place (torchao's `swap_linear_layers`, as
    `convert_to_float8_training` does); the number swapped. `size_filter=False` keeps only the multiple-of-16 rule
    (CPU tests, whose models are far below torchao's thresholds).

    `fsdp2`: the model is sharded by FSDP2 next: torchao's own `Float8Linear` (FSDP2 swaps whole parameters, the
    leaf-weight variant below is ZeRO-3's), with tensorwise scaling its weights all-gathered in float8 (half the bytes
    of bf16: each shard cast with the scale of the whole weight, precomputed after every optimizer step by
    `step_callbacks`). `fp32_master`: the linears' weights cast to fp32 before they are wrapped, as
    accelerate's FSDP2 prepare casts every trainable weight under mixed precision (its `param.data = ...float()` on
    torchao's weight wrapper changes the wrapper's dtype but not the tensor it wraps, which would stay bf16)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_linear_utils import swap_linear_layers

    config = Float8LinearConfig.from_recipe_name(recipe)
    if not torch.cuda.is_available():  # the CPU tests: the same float8 casts, the matmul emulated (see the module)
        config = dataclasses.replace(config, emulate=True)
    if fsdp2 and all_gathers_float8(recipe):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    keep = layer_filter(recipe if size_filter else None, architectures.decoder_prefixes(model))
    linear_class = Float8Linear if fsdp2 else _leaf_weight_float8_linear()

    def swap(module: torch.nn.Module) -> torch.nn.Module:
        return linear_class.from_float(module.float() if fp32_master else module, config=config)

    swap_linear_layers(model, swap, module_filter_fn=keep)
    converted = [name for name, m in model.named_modules() if isinstance(m, linear_class)]
    if fsdp2 and all_gathers_float8(recipe):
        _addressable(model, linear_class)
    if not converted:
        linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        widths = sorted({tuple(getattr(m.weight, "ds_shape", m.weight.shape)) for m in linear})
        raise ConfigError(
            f"`fp8: true`: no decoder linear layer is large enough for {recipe} float8 (torchao's filter; weight "
            f"shapes here {widths}). FP8 would only add casts to this model: set fp8: false (or auto)."
        )
    return len(converted)


def _addressable(model: torch.nn.Module, linear_class) -> None:
    """Each float8-all-gathered weight's `data_ptr()` made its storage's address.

    Why: torchao's weight wrapper (`WeightWithDynamicFloat8CastTensor`) has no storage of its own and answers 0, and
    accelerate's FSDP2 prepare re-points the optimizer at the sharded parameters by the old ones' `data_ptr()`
    (`Accelerator._prepare_fsdp2`); it looks inside the wrapper only when accelerate itself did the float8
    conversion. With every float8 weight at address 0, each optimizer entry would map to the same sharded weight and
    the others would never be stepped (measured on CPU: the linear weights stayed at their init)."""
    for module in model.modules():
        if isinstance(module, linear_class):
            module.weight.data_ptr = module.weight._tensor.data_ptr


@functools.cache
def _leaf_weight_float8_linear():
    """torchao's `Float8Linear`, except that its matmul saves the weight parameter for the backward, not the
    transposed view torchao passes in.

    Why: ZeRO-3 gathers a partitioned weight for the forward, frees it after, and gathers it again for the backward by
    swapping the parameter's data. A saved view keeps the forward's gathered storage alive until the backward (all
    converted layers' full weights at once, which is what ZeRO-3 exists to avoid) and backpropagates through that
    copy; the parameter itself is read again when the backward runs, as DeepSpeed's own ZeRO-3 linear does. The casts,
    scales and matmuls are torchao's own functions; only what is saved differs.
    """
    from types import SimpleNamespace

    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    class _Discard:
        def save_for_backward(self, *tensors):
            pass

    @torch._dynamo.allow_in_graph
    class LeafWeightMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_hp, weight, linear_mm_config, config):
            ctx.save_for_backward(input_hp, weight)
            ctx.linear_mm_config, ctx.config = linear_mm_config, config
            return matmul_with_hp_or_float8_args.forward(_Discard(), input_hp, weight.t(), linear_mm_config, config)

        @staticmethod
        def backward(ctx, grad_output):
            input_hp, weight = ctx.saved_tensors
            saved = SimpleNamespace(
                saved_tensors=(input_hp, weight.t()), linear_mm_config=ctx.linear_mm_config, config=ctx.config
            )
            grad_input, grad_weight_t, *_ = matmul_with_hp_or_float8_args.backward(saved, grad_output)
            return grad_input, grad_weight_t.t(), None, None

    class LeafWeightFloat8Linear(Float8Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as torchao's forward: the output in the autocast dtype
                input = input.to(torch.get_autocast_gpu_dtype())
            output = LeafWeightMatmul.apply(input, self.weight, self.linear_mm_config, self.config)
            if self.bias is not None:
                output = output + self.bias.to(output.dtype)
            return output

    return LeafWeightFloat8Linear


def step_callbacks(model: torch.nn.Module) -> list:
    """The trainer callbacks FP8 needs: with weights that FSDP2 all-gathers in float8 (`convert(fsdp2=True)`), one
    that, after every optimizer step, computes their float8 scales at once (torchao's
    `precompute_float8_dynamic_scale_for_fsdp`: one all-reduce of every weight's amax) instead of one all-reduce per
    weight in each all-gather. The scales are the same either way (the amax of the whole weight): a resumed run's
    first step, with none precomputed, computes them in the all-gather."""
    gathered = any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
                   for m in model.modules() if type(m).__name__ == "Float8Linear")  # fmt: skip
    if not gathered:
        return []
    import logging

    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from transformers import TrainerCallback

    logging.getLogger(__name__).info("FP8 under FSDP2: the float8 weights all-gathered in float8, their scales "
                                     "precomputed after each optimizer step (one all-reduce)")  # fmt: skip

    class PrecomputedScales(TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            precompute_float8_dynamic_scale_for_fsdp(model)

    return [PrecomputedScales()]
