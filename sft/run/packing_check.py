"""The packing check (`packing_check`): before the first step, a few of the run's own packed rows through the run's own
model, against each of their samples alone.

A packed row is exact only where every layer keeps its samples apart: the attention backend through the samples'
boundaries, a recurrent or convolutional layer by restarting its state at each one. sft's suite checks the families of
its architecture table (tests/test_architectures.py); a model outside it (`packing_check: auto`), or any model
(`true`), is checked here on its own weights and data: the first rows of the training set, collated as training
collates them, through the model in eval mode without gradients; each of their first samples again alone (positions
from 0, no other sample in the row); and the rows once more with the first sample's tokens changed. Two figures per
sample, each a mean absolute difference of the last hidden states over their mean absolute value: against the sample
alone (a kernel's rounding moves it by the dtype's noise, which in bf16 reaches a few 1e-2 where experts flip), and
the later samples' move when the first sample's tokens change (its influence: exactly or nearly 0 where the samples
are kept apart, whatever the dtype; a leak moves every token that could see the first sample). A leak (influence
above its tolerance), or a sample far from itself alone (beyond what rounding explains), refuses packing with the
figures, naming the fix.

Every process runs the same rows (the dataset's first ones, not its shard), so a sharded engine's forwards match:
checked under DeepSpeed ZeRO-2 and FSDP2 (2 processes, CPU). Not under DeepSpeed's ZeRO-3: forwards before the first
step (through its engine, with or without gradients, in eval or train mode) make its first backward fail (DeepSpeed
0.19.8: "The size of tensor a (0) must match ..."), so the plan leaves the check off there, saying so.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from sft.errors import ConfigError

logger = logging.getLogger(__name__)

# The mean relative difference of a sample's last hidden states from the sample alone above which packing computes
# something else: fp32's rounding is ~1e-7 (tests/test_packing_check.py); bf16's up to 5.7e-2 with exact backends on a
# GPU (gpt-oss, Gemma 4 MoE: experts flipping on rounding; benchmarks/results/packing_check_gpu), so in 16 bits this
# figure only catches what is far from rounding, and the influence below catches a leak
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
TOLERANCE_16BIT = 0.2
# The relative move of a later sample's last hidden states when the first sample's tokens change, above which it reads
# them (a leak): an exact model's is 0 in fp32 up to ~1e-7 (tests/test_packing_check.py) and in bf16 on a GPU at most
# 2.2e-5 over 12 families, where attention blind to the boundaries moves them by 8.3e-3 (Qwen3.5's) to 1.3
# (benchmarks/results/packing_check_gpu)
INFLUENCE = {torch.float32: 1e-4, torch.float64: 1e-8}
INFLUENCE_16BIT = 1e-3
MAX_SAMPLES = 8  # samples compared (each one more forward); the rows are taken until they hold this many
MAX_ROWS = 4


@dataclass(frozen=True)
class Result:
    rows: int
    samples: int  # compared one by one (the first sample of each row is compared too: nothing precedes it)
    differences: tuple[float, ...]  # per sample, in order
    tolerance: float
    seconds: float
    # per sample after the first: how far its last hidden states move when the first sample's tokens change (the leak
    # itself; an exact model's later samples do not read the first one's tokens), and the tolerance of that figure
    influence: tuple[float, ...] = ()
    influence_tolerance: float = 0.0

    @property
    def worst(self) -> float:
        return max(self.differences, default=0.0)

    @property
    def leaks(self) -> bool:
        """A later sample moved by the first one's tokens, or the samples' figures beyond what rounding explains."""
        return max(self.influence, default=0.0) > self.influence_tolerance or self.worst > self.tolerance

    def sentence(self) -> str:
        figures = ", ".join(f"{d:.1e}" for d in self.differences)
        moved = ", ".join(f"{d:.1e}" for d in self.influence)
        return (
            f"{self.samples} samples of {self.rows} packed rows against each alone: mean relative difference of the "
            f"last hidden states {figures} (tolerance {self.tolerance:.0e}); the later samples moved by changing "
            f"the first one's tokens: {moved or 'none'} (tolerance {self.influence_tolerance:.0e}); "
            f"{self.seconds:.1f} s"
        )


def bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sample of a flattened padding-free row, from its positions restarting at 0."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten().tolist() or [0]
    if starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, [*starts[1:], flat.numel()], strict=True))


def _last_hidden(model, inputs: dict, extra: dict) -> torch.Tensor:
    out = model(**inputs, output_hidden_states=True, use_cache=False, **extra)
    return out.hidden_states[-1][0].float()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12))


def compare(model, batch: dict, rows: int = 1, dtype=None, inner=None, max_samples: int = MAX_SAMPLES) -> Result:
    """One collated padding-free batch of `rows` packed rows (`input_ids` and `position_ids` [1, tokens], as the
    trainer's collator makes it) packed, then its first `max_samples` samples alone, then packed again with the first
    sample's tokens changed (each id the next one); the model in eval mode, no gradients. `model` is what the trainer
    calls (an engine's wrapper), `inner` the transformers model inside it; `dtype` what the forward computes in (bf16
    under mixed precision), else the weights' dtype."""
    inner = inner if inner is not None else model
    keep_one = "logits_to_keep" in inspect.signature(inner.forward).parameters  # the hidden states, not the logits
    extra = {"logits_to_keep": 1} if keep_one else {}
    start = time.perf_counter()
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "seq_lengths", "completion_mask")}
    spans = bounds(batch["position_ids"])[:max_samples]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = _last_hidden(model, inputs, extra)
            differences = []
            for lo, hi in spans:
                ids = batch["input_ids"][:, lo:hi]
                positions = torch.arange(hi - lo, device=ids.device)[None]
                alone = _last_hidden(model, {"input_ids": ids, "position_ids": positions}, extra)
                differences.append(_relative(packed[lo:hi], alone))
            changed = inputs["input_ids"].clone()
            first = slice(*spans[0])
            changed[:, first] = (changed[:, first] + 1) % inner.get_input_embeddings().num_embeddings
            moved = _last_hidden(model, {**inputs, "input_ids": changed}, extra)
            influence = tuple(_relative(moved[lo:hi], packed[lo:hi]) for lo, hi in spans[1:])
    finally:
        model.train(was_training)
    dtype = dtype or next(inner.parameters()).dtype
    tolerance = TOLERANCE.get(dtype, TOLERANCE_16BIT)
    return Result(rows, len(differences), tuple(differences), tolerance, time.perf_counter() - start, influence,
                  INFLUENCE.get(dtype, INFLUENCE_16BIT))  # fmt: skip


def first_rows(dataset, collator, device) -> tuple[dict, int]:
    """The dataset's first packed rows (the same on every process), collated as training collates them, until they
    hold `MAX_SAMPLES` samples or `MAX_ROWS` rows; and how many rows."""
    rows, samples = [], 0
    for index in range(min(len(dataset), MAX_ROWS)):
        row = dataset[index]
        rows.append(row)
        samples += len(row.get("seq_lengths") or [0])
        if samples >= MAX_SAMPLES:
            break
    batch = collator(rows)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, len(rows)


def check(model, inner, dataset, collator, args, why: str) -> Result | None:
    """Run the check on the dataset's first rows with the training arguments' device and mixed precision through
    `model` (what the trainer calls: an engine's wrapper keeps its own state of the forwards, ZeRO-3's prefetch trace);
    log the figures; refuse packing on a leak. None, said, for a streamed dataset (no first rows to read without
    consuming them)."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        logger.warning("Packing check (%s): not run: the training set is streamed (%s)", why, type(dataset).__name__)
        return None
    batch, rows = first_rows(dataset, collator, args.device)
    mixed = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None  # autocast by accelerate
    result = compare(model, batch, rows, dtype=mixed, inner=inner)
    if result.leaks:
        leak = max(result.influence, default=0.0) > result.influence_tolerance
        cause = ("Something in this model lets a packed sample see the one before it (an attention backend or a "
                 "recurrent layer that does not take the samples' boundaries)" if leak else
                 "No sample reads another, but a packed sample computes something other than itself alone (positions "
                 "that do not restart at each sample?)")  # fmt: skip
        raise ConfigError(
            f"Packing check ({why}): packed samples do not compute what they compute alone: {result.sentence()}. "
            f"{cause}. Set packing: false and padding_free: false to train on padded batches, or packing_check: false "
            "if you know why the figures differ."
        )
    logger.info("Packing check (%s): %s: exact", why, result.sentence())
    return result


class Callback(TrainerCallback):
    """Runs the check when training begins (the model built, the engine ready: every process the same forwards)."""

    def __init__(self, trainer, why: str):
        self.trainer, self.why = trainer, why
        self.result: Result | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        t = self.trainer
        self.result = check(t.model_wrapped, model, t.train_dataset, t.data_collator, args, self.why)
        return control
