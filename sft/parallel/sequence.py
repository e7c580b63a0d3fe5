"""Sequence parallelism: the tokens of one packed row split over `sp` ranks (Ulysses, DeepSpeed ALST).

The engine is DeepSpeed's and accelerate's (the engine's `sequence_parallel_config`, `sft.engines.deepspeed.ulysses`:
`ParallelismConfig(sp_backend="deepspeed")`), which makes transformers' Trainer
register `UlyssesSPAttentionHF` (an all-to-all before and after attention, so each rank attends over the whole row
with `heads / sp` heads), pass DeepSpeed the sequence-parallel groups, and wrap the training data loader in
`UlyssesSPDataLoaderAdapter` (the sp ranks of a replica take turns: each rank's batch is cut into `sp` contiguous
slices and every rank trains one slice). What this module adds is what those leave to the user:

- **Packing stays exact.** TRL's padding-free collator puts the boundaries of the packed samples in every batch as
  whole-row tensors (`cu_seq_lens_q`, ...) that cannot be sliced along the sequence; they are dropped before the
  split and handed back whole with every training micro-batch (`row_boundaries`), since Ulysses gives the attention
  the whole row (`sft.model.attention`: `sft_varlen`, PyTorch's varlen FlashAttention-2 on CUDA and an exact per-sample
  sdpa on CPU; without them it derives the boundaries from the gathered `position_ids`).
  `sdpa` is refused: under Ulysses it attends across the samples of a row. Rows are padded to a multiple of `sp`
  only (at most sp - 1 tokens, labels -100, each its own one-token "sample"), and that padding is not counted as
  tokens or FLOPs: the real sample lengths travel with the batch as `ShardInfo`.
- **The loss is the one without SP.** transformers' Ulysses loss averages each micro-batch over its own tokens, so
  with gradient accumulation micro-batches of few tokens weigh as much as full ones. Here every rank's loss is the sum
  of its tokens' losses over the tokens of the whole optimizer step (all replicas, all accumulation steps), as
  TRL's loss is without SP, from TRL's fused LM head; `loss_scale` gives the factor.
- **Checks before any model is built**: sp divides the world size and the attention heads, DeepSpeed is on, the
  batches are padding-free, the backend can do it. Each micro-batch is one packed row (`per_device_train_batch_size`
  1, the batch Ulysses' attention wrapper is sized for); accumulation makes up the global batch.

`ParallelDims.sp` (from `sequence_parallel_size`) is the size everything else reads: the batch arithmetic counts the
global batch over `dp = world / sp` replicas, the memory planner divides activations by sp, the fingerprint holds it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from sft.errors import ConfigError
from sft.model import architectures
from sft.model.attention import boundaries_from_positions

logger = logging.getLogger(__name__)

# Whole-row tensors of TRL's padding-free collator that cannot be sliced along the sequence
ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
INFO_KEY = "sft_shard_info"
# Backends that keep packed samples apart when Ulysses hands them the whole row with `attention_mask=None`
SP_BACKENDS = ("sft_varlen", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class ShardInfo:
    """What one micro-batch held before it was split over the sp ranks: the real sample lengths (padding excluded),
    the padded row length and, with `trace_data`, a digest per sample."""

    lengths: tuple[int, ...]
    padded: int
    samples: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def check(dims, engine, training_args, padding_free: bool) -> None:
    """Refuse a sequence-parallel setting that cannot run, before data or model are loaded (`engine`: the run's, as
    the plan built it)."""
    if dims.sp == 1:
        return
    if not (engine.on and engine.traits.sequence_parallel):
        raise ConfigError(
            f"`sequence_parallel_size: {dims.sp}` runs on DeepSpeed (Ulysses / ALST): add `--deepspeed "
            "ds_configs/zero2.json` (or zero3), or set sequence_parallel_size: 1."
        )
    if not padding_free:
        raise ConfigError(
            f"`sequence_parallel_size: {dims.sp}` needs padding-free batches, whose samples are kept apart by their "
            "position_ids: set `packing: true` (or `padding_free: true`)."
        )
    micro = training_args.per_device_train_batch_size
    if micro != 1 and "per_device_train_batch_size" not in training_args.auto_settings:
        raise ConfigError(
            f"`per_device_train_batch_size: {micro}` with `sequence_parallel_size: {dims.sp}`: each sequence-parallel "
            "micro-batch is one packed row (DeepSpeed's Ulysses attention is sized for a 1-row batch). Set "
            "per_device_train_batch_size: 1 (or auto); gradient accumulation makes up the global batch."
        )
    evaluation = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy))
    if evaluation != "no":
        # Measured on the demo (2 processes, sp=2 vs 1, train losses equal to 1e-6): eval_loss 4.4440 vs 4.4372 and
        # mean token accuracy 0.187 vs 0.251: the eval batches do not go through the sequence-parallel path
        raise ConfigError(
            f"`eval_strategy: {evaluation}` with `sequence_parallel_size: {dims.sp}`: evaluation during a "
            "sequence-parallel run gives a wrong eval loss (its batches do not take the sequence-parallel path). Set "
            "eval_strategy: no and evaluate the saved model (`sft eval`), or set sequence_parallel_size: 1."
        )


def splits_heads(heads: int, kv_heads: int, sp: int) -> bool:
    """DeepSpeed's Ulysses rule: sp divides the attention heads, and divides or is a multiple of the key/value heads
    (it replicates key/value heads when there are fewer than sp)."""
    return heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def check_model(config, sp: int, attn_implementation: str | None, arch=None) -> None:
    """The model's attention can be split over `sp` ranks by heads, with a backend that keeps samples apart."""
    if sp == 1:
        return
    if attn_implementation not in SP_BACKENDS:
        raise ConfigError(
            f"`attn_implementation: {attn_implementation}` cannot do sequence parallelism with packing: Ulysses hands "
            "the attention the whole row without a mask, and this backend would attend across samples. Use `auto` "
            f"(or one of {list(SP_BACKENDS)}), or set sequence_parallel_size: 1."
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not heads or getattr(text, "is_encoder_decoder", False):
        raise ConfigError(
            f"sequence parallelism: DeepSpeed's Ulysses wraps the attention of transformers decoder models with "
            f"`num_attention_heads`; {type(config).__name__} ({getattr(config, 'model_type', '?')}) has none. Set "
            "sequence_parallel_size: 1."
        )
    arch = arch or architectures.of(config)
    attention = arch.attention
    recurrent = (*attention.other_layers, *attention.per_sample)
    if recurrent:
        raise ConfigError(
            f"sequence parallelism: {getattr(config, 'model_type', '?')} has {list(recurrent)} layers, which "
            "Ulysses cannot split along the sequence. Set sequence_parallel_size: 1."
        )
    kv_heads = next((k for k in sorted(set(arch.kv_head_counts)) if not splits_heads(heads, k, sp)), arch.kv_heads)
    if not splits_heads(heads, kv_heads, sp):
        raise ConfigError(
            f"`sequence_parallel_size: {sp}` must divide the model's {heads} attention heads, and divide or be a "
            f"multiple of its {kv_heads} key/value heads. Use one of "
            f"{[d for d in range(1, heads + 1) if all(splits_heads(heads, k, d) for k in arch.kv_head_counts)]}."
        )


class ShardableCollator:
    """TRL's padding-free collator, its output made sliceable along the sequence: the whole-row boundary tensors
    dropped, the row padded to a multiple of `sp` x `token_multiple` (input pad token, label -100, position 0), and a
    `ShardInfo` added (a non-tensor value, which the data loader adapter copies to every sp rank unchanged)."""

    def __init__(self, collator, sp: int, pad_token_id: int, trace: bool = False, token_multiple: int = 1):
        self.collator, self.pad_token_id, self.trace = collator, pad_token_id, trace
        self.multiple = sp * token_multiple  # each rank's share a multiple of `token_multiple` (16 with FP8)

    def __call__(self, examples):
        batch = self.collator(examples)
        input_ids = batch["input_ids"]
        if input_ids.shape[0] != 1 or "position_ids" not in batch:
            raise ConfigError("sequence parallelism needs padding-free batches (one row with position_ids).")
        cu = batch.get("cu_seq_lens_q")
        lengths = (cu if cu is not None else boundaries_from_positions(batch["position_ids"])).diff().tolist()
        samples = ()
        if self.trace:
            samples = tuple(
                hashlib.sha1(s.numpy().tobytes()).hexdigest()[:16] for s in input_ids[0].cpu().split(lengths)
            )
        for key in ROW_KEYS:
            batch.pop(key, None)
        pad = -input_ids.shape[1] % self.multiple
        if pad:
            for key, value in (("input_ids", self.pad_token_id), ("labels", -100), ("position_ids", 0)):
                batch[key] = torch.nn.functional.pad(batch[key], (0, pad), value=value)
        batch[INFO_KEY] = ShardInfo(tuple(lengths), input_ids.shape[1] + pad, samples)
        return batch


def row_boundaries(info: ShardInfo, device) -> dict:
    """The whole row's sample boundaries for the attention, which Ulysses hands the whole row. The padding (at most
    sp - 1 tokens at the end of the row) is counted into the last sample: under causal attention no earlier token
    sees it, and its positions carry no loss, so the real tokens' outputs and gradients are those without it; a row
    of one sample stays one sample (which `sft.model.attention` runs on the faster non-varlen kernel). Given with every
    micro-batch, the attention does not derive the boundaries from the gathered position_ids in every layer (a
    device-to-host copy per layer, which stalls the launch queue)."""
    lengths = list(info.lengths or (0,))
    lengths[-1] += info.padded - info.tokens
    cu = torch.nn.functional.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    cu = cu.to(device)
    longest = max(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def take_info(inputs: dict) -> ShardInfo | None:
    """Remove the ShardInfo from a batch before it reaches the model."""
    return inputs.pop(INFO_KEY, None)


def loss_scale(divisor: int, step_targets) -> torch.Tensor:
    """The factor on a rank's summed token losses that gives, after DeepSpeed, the gradient of the loss without SP.

    Without SP, TRL's loss is the sum of token losses over the trained tokens of the whole optimizer step
    (`step_targets`: every replica, every accumulation step), and DeepSpeed averages the replicas' gradients. Under
    SP every rank holds a slice of a row: DeepSpeed sums all ranks' gradients and divides by `divisor`
    (`Engine.gradient_divisor`: the data-parallel size, or the world size on ZeRO-3's reduce-scatter
    path), so each rank's summed loss is multiplied by divisor / step_targets. No collective enters the backward
    (transformers' Ulysses loss all-gathers the ranks' losses differentiably, which on gloo fails for any sp group
    but the first: torch's all-to-all fallback scatters from group ranks as if they were global ranks). The Trainer
    logs the mean of the ranks' losses, which is then the step's loss x divisor / world: `training_step` reports it
    x world / divisor.
    """
    return divisor / torch.as_tensor(step_targets, dtype=torch.float32).clamp(min=1)


class TrainerSteps:
    """Sequence parallelism inside the trainer: what `sft.run.trainer.Trainer` calls at each of its steps when the
    plan's sp is above 1 (`of` gives None otherwise). Ulysses itself is transformers' and DeepSpeed's; these keep
    packing exact (`before_step`), the loss the one without SP (`loss`, `scaled`, `step_tokens`) and a resume exact
    through DeepSpeed's data-loader adapter (`loader`)."""

    def __init__(self, plan):
        self.plan = plan
        self.dims = plan.dims
        self.divisor: int | None = None  # the engine's gradient divisor, fixed for the run (`attach`)

    @classmethod
    def of(cls, plan) -> TrainerSteps | None:
        return cls(plan) if plan.dims.sp > 1 else None

    def configure(self, training_args) -> None:
        """Before the trainer is built: accelerate's Ulysses configuration on the training arguments."""
        engine = self.plan.engine
        training_args.parallelism_config = engine.sequence_parallel_config(self.dims, self.plan.attn_implementation)

    def attach(self, trainer) -> None:
        """After the trainer is built: batches that can be sliced over the sp ranks, and a loss scaled for the whole
        optimizer step (`loss`)."""
        from sft.model import fp8

        self.divisor = self.plan.engine.gradient_divisor()
        args = trainer.args
        trainer.data_collator = ShardableCollator(
            trainer.data_collator, self.dims.sp, trainer.processing_class.pad_token_id, args.trace_data,
            fp8.token_multiple(args.fp8),
        )  # fmt: skip
        trainer.loss_is_scaled_for_ga = True  # `loss` divides by the tokens of the whole optimizer step

    def loader(self, trainer, train_dataloader, resume_from_checkpoint):
        """The engine's sequence-parallel loader; on a resume it skips this epoch's trained micro-batches itself
        (transformers' skip, accelerate's `skip_first_batches`, cannot go through the adapter) and tells
        transformers not to skip again."""
        from sft.core.batch import steps_per_epoch

        loader = self.plan.engine.sequence_parallel_loader(train_dataloader)
        args, step = trainer.args, trainer.state.global_step
        if resume_from_checkpoint and step and not args.ignore_data_skip:
            per_epoch = steps_per_epoch(len(loader), args.gradient_accumulation_steps)
            skipped = step % per_epoch * args.gradient_accumulation_steps
            loader.skip(skipped)
            args.ignore_data_skip = True
            trainer._load_rng_state(resume_from_checkpoint)  # what transformers does after its own skip
            logger.info("Sequence parallel resume: skipped %d micro-batches of this epoch", skipped)
        return loader

    def before_step(self, inputs: dict, device) -> ShardInfo | None:
        """The micro-batch's shard info taken out of it, and the whole row's sample boundaries put back in."""
        info = take_info(inputs)
        if info is not None:
            inputs.update(row_boundaries(info, device))
        return info

    def scaled(self, loss):
        """What each rank backpropagates is scaled for the engine's gradient divisor (`loss`); the Trainer logs the
        mean over all ranks, so the step's loss is world / divisor x that."""
        return loss * (self.dims.world_size / self.divisor)

    def loss(self, trainer, model, inputs, num_items_in_batch, info: ShardInfo):
        """TRL's loss without SP, from the same fused LM head, on this rank's slice of the row (`loss_scale`); TRL's
        metrics as TRL keeps them, the tokens counted once per row."""
        outputs = model(**inputs, use_cache=False, fused_lm_head=True)
        loss = -outputs.log_probs.sum() * loss_scale(self.divisor, num_items_in_batch)
        gather, metrics = trainer.accelerator.gather_for_metrics, trainer._metrics["train"]
        valid = gather(outputs.label_mask.sum()).sum()
        entropy, correct = gather(outputs.entropy.detach().sum()).sum(), gather(outputs.is_top1.sum()).sum()
        metrics["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)
        tokens = torch.tensor(float(info.tokens) if self.dims.sp_rank == 0 else 0.0, device=trainer.args.device)
        trainer._total_train_tokens += int(trainer.accelerator.reduce(tokens, reduction="sum"))
        metrics["num_tokens"] = [trainer._total_train_tokens]
        return loss

    def step_tokens(self, trainer, batch_samples, device):
        """The trained tokens of the optimizer step, over every replica, each counted once (transformers' count is
        off for Ulysses, which does not use it)."""
        count = sum((batch["shift_labels"] != -100).sum() for batch in batch_samples).to(device)
        return trainer.accelerator.reduce(count, reduction="sum")
