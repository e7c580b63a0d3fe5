"""`sft data RECIPE`: what a recipe's data looks like once tokenised, before any training.

    sft data recipes/demo.yaml                     # per source and in total, for one process
    sft data recipes/demo.yaml --gpus 8            # steps per epoch on 8 data-parallel processes
    sft data recipes/demo.yaml --max_length 256    # any recipe field, as for training

Per source and in total: records, the token-length distribution (min / median / p90 / p99 / max, and a histogram),
records longer than `max_length` and what happens to them (packing: cut at `max_length`, the rest dropped; without
packing: truncated as `truncation_mode` says), trained (labelled) tokens per record, and for the total the packed
rows, the packing efficiency the packer reaches (real tokens / (rows x max_length), the figure training logs) and
optimizer steps per epoch at the recipe's global batch. It loads, checks and tokenises with the code training runs:
sft's loading and checks (`sft.data.load`), then TRL's own dataset preparation (`SFTTrainer._prepare_dataset`: the same
map steps, so the same datasets cache: a training run after `sft data` tokenised nothing again; only the packed rows'
cache file was written anew, a pyarrow pass), and TRL's packer. Training prints the short form of the total at its
start and writes the figures to `<output_dir>/data_stats.json` (the report plots the length histogram).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from sft.core import flags
from sft.core.outputs import STATS_FILE
from sft.core.recipe import with_config
from sft.errors import DataError, SFTError

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


@dataclass
class Stats:
    """Token counts of one dataset (a source, or the mix that trains)."""

    name: str
    lengths: list[int]  # tokens per record, untruncated
    trained: list[int]  # labelled tokens per record (the loss is on these)
    max_length: int | None
    packing: bool
    rows: int | None = None  # packed rows (total only)
    packed_tokens: int | None = None
    steps_per_epoch: int | None = None
    global_batch: int | None = None
    answers: list[tuple[int, int]] | None = None  # per record, the first and last labelled token's index (-1: none)
    keep_end: bool = False  # unpacked rows truncated from the start (`truncation_mode: keep_end`)

    @property
    def records(self) -> int:
        return len(self.lengths)

    @property
    def over(self) -> int:
        return sum(n > self.max_length for n in self.lengths) if self.max_length else 0

    @property
    def answerless(self) -> int:
        """Records that keep no labelled token once rows are cut to max_length: their loss would be 0."""
        if not self.max_length or self.answers is None:
            return sum(n == 0 for n in self.trained)
        if self.keep_end:
            return sum(last < n - self.max_length for (_, last), n in zip(self.answers, self.lengths, strict=True))
        return sum(first < 0 or first >= self.max_length for first, _ in self.answers)

    @property
    def efficiency(self) -> float | None:
        if not self.rows or not self.max_length:
            return None
        return self.packed_tokens / (self.rows * self.max_length)

    def distribution(self) -> dict[str, float]:
        a = np.asarray(self.lengths)
        out = {"min": int(a.min()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}, "max": int(a.max())}
        return out | {"mean": float(a.mean())}

    def as_json(self) -> dict:
        d = {"name": self.name, "records": self.records, "tokens": int(sum(self.lengths)),
             "trained_tokens": int(sum(self.trained)), "length": self.distribution(), "max_length": self.max_length,
             "over_max_length": self.over, "length_histogram": histogram_counts(self.lengths)}  # fmt: skip
        if self.rows is not None:
            d |= {"packed_rows": self.rows, "packed_tokens": self.packed_tokens, "packing_efficiency": self.efficiency,
                  "global_batch_rows": self.global_batch, "steps_per_epoch": self.steps_per_epoch}  # fmt: skip
        return d


def histogram_counts(lengths: list[int], bins: int = 20) -> dict[str, list]:
    """Records per bin of whole token counts, `edges[i]` to `edges[i + 1] - 1` tokens, at most `bins` bins of one
    width (one bin per length when the lengths span at most `bins` values)."""
    lo, hi = min(lengths), max(lengths)
    width = math.ceil((hi - lo + 1) / bins)  # whole tokens, every bin as wide
    edges = np.arange(lo, hi + width + 1, width)
    counts, _ = np.histogram(lengths, bins=edges)
    return {"counts": counts.tolist(), "edges": edges.tolist()}


def text_histogram(lengths: list[int], bins: int = 20, width: int = 40) -> str:
    h = histogram_counts(lengths, bins)
    top = max(h["counts"]) or 1
    lines = []
    for count, lo, hi in zip(h["counts"], h["edges"], h["edges"][1:], strict=False):
        hi = min(hi - 1, max(lengths))
        span = f"{lo}" if hi == lo else f"{lo}-{hi}"
        bar = "#" * round(width * count / top) or ("." if count else "")
        lines.append(f"    {span:>15} {count:>9,} {bar}")
    return "\n".join(lines)


def _preparer(tokenizer, training_args, sample: dict):
    """What `SFTTrainer._prepare_dataset` reads from the trainer, set as `SFTTrainer.__init__` sets it."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    chat_template = None
    if training_args.assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
        chat_template = get_training_chat_template(tokenizer)
    completion_only = training_args.completion_only_loss
    if completion_only is None:
        completion_only = "prompt" in sample and "completion" in sample
    return SimpleNamespace(chat_template=chat_template, completion_only_loss=completion_only, _tokenizer=tokenizer)


def tokenized(dataset, tokenizer, training_args, name: str, packing: bool = False):
    """`dataset` through TRL's preparation: per record (`packing=False`, nothing truncated) or packed as training
    packs it (`packing=True`, the recipe's max_length and strategy)."""
    from trl import SFTTrainer

    args = training_args
    if not packing:  # a shallow copy, not `dataclasses.replace`: that re-runs the recipe checks (tiled_mlp needs
        args = copy.copy(training_args)  # max_length, and refused the copy under sequence parallelism)
        args.max_length, args.shuffle_dataset = None, False
    stand_in = _preparer(tokenizer, training_args, next(iter(dataset)))
    return SFTTrainer._prepare_dataset(stand_in, dataset, tokenizer, args, packing, None, name)


def measure(dataset, tokenizer, training_args, name: str) -> Stats:
    records = tokenized(dataset, tokenizer, training_args, name)
    lengths = [len(ids) for ids in records["input_ids"]]
    trained, answers = [], []
    for labels in records["labels"]:
        where = [i for i, label in enumerate(labels) if label != -100]
        trained.append(len(where))
        answers.append((where[0], where[-1]) if where else (-1, -1))
    keep_end = not training_args.packing and getattr(training_args, "truncation_mode", "keep_start") == "keep_end"
    return Stats(name, lengths, trained, training_args.max_length, bool(training_args.packing), answers=answers,
                 keep_end=keep_end)  # fmt: skip


def check_answers_kept(stats: Stats) -> None:
    """Refuse a max_length that leaves no record a labelled token (every loss 0, nothing to train on); warn when it
    takes them from some records."""
    lost = stats.answerless
    if not lost or not stats.max_length:
        return
    firsts = sorted(first for first, _ in stats.answers or [] if first >= 0)
    needed = (f" The first answer token is at position {firsts[0]} at the earliest, {firsts[len(firsts) // 2]} in "
              f"the median record: max_length {firsts[len(firsts) // 2] + 1} or more keeps half of them."
              if firsts and not stats.keep_end else "")  # fmt: skip
    message = (f"`max_length: {stats.max_length}` cuts every answer token from {lost:,} of {stats.records:,} records "
               f"of the {stats.name} (their loss would be 0).{needed}")  # fmt: skip
    if lost == stats.records:
        raise DataError(f"{message} Nothing would be trained: raise max_length.")
    logger.warning("%s Raise max_length to train on them.", message)


def add_packing(stats: Stats, dataset, tokenizer, training_args, gpus: int, batch=None) -> Stats:
    """Packed rows and efficiency (as training packs), and optimizer steps per epoch on `gpus` processes (with a run's
    `batch`, `sft.core.batch.BatchPlan`: at its batch)."""
    from sft.core.batch import plan_batch

    rows = len(stats.lengths)
    if training_args.packing and training_args.max_length:
        packed = tokenized(dataset, tokenizer, training_args, stats.name, packing=True)
        rows = len(packed)
        stats.packed_tokens = int(sum(sum(s) for s in packed["seq_lengths"]))
    else:
        cap = training_args.max_length or max(stats.lengths)
        stats.packed_tokens = int(sum(min(n, cap) for n in stats.lengths))
    stats.rows = rows
    if batch is None:
        micro = training_args.per_device_train_batch_size
        micro = micro if isinstance(micro, int) else 1  # `auto` without a GPU to plan for: 1
        batch = plan_batch(
            gpus,
            micro,
            training_args.global_batch_size,
            training_args.tokens_per_step,
            training_args.max_length,
            training_args.gradient_accumulation_steps,
        )
    stats.steps_per_epoch = batch.steps_per_epoch(rows)
    stats.global_batch = batch.global_batch_size
    return stats


def describe(stats: Stats, long: bool = True) -> str:
    d = stats.distribution()
    lines = [
        f"{stats.name}: {stats.records:,} records, {sum(stats.lengths):,} tokens "
        f"({sum(stats.trained):,} trained, {np.mean(stats.trained):.1f} per record)",
        f"  tokens per record: min {d['min']}, median {d['p50']:.0f}, p90 {d['p90']:.0f}, p99 {d['p99']:.0f}, "
        f"max {d['max']}",
    ]
    if stats.max_length:
        fate = (
            "cut at max_length by the packer, the rest dropped"
            if stats.packing
            else "truncated to max_length (truncation_mode)"
        )
        lines.append(f"  longer than max_length {stats.max_length}: {stats.over:,} ({stats.over / stats.records:.1%})"
                     + (f": {fate}" if stats.over else ""))  # fmt: skip
    if stats.answerless:
        lines.append(f"  records left without an answer token (loss 0): {stats.answerless:,} "
                     f"({stats.answerless / stats.records:.1%})")  # fmt: skip
    if long:
        lines.append("  records by tokens per record:\n" + text_histogram(stats.lengths))
    if stats.rows is not None:
        eff = f", packing efficiency {stats.efficiency:.1%}" if stats.efficiency is not None else ""
        lines.append(f"  {'packed rows' if stats.packing else 'rows'}: {stats.rows:,}{eff}; {stats.steps_per_epoch:,} "
                     f"optimizer steps per epoch at a global batch of {stats.global_batch} rows")  # fmt: skip
    return "\n".join(lines)


def skipped(train_dataset, training_args) -> str | None:
    """Why training's data figures are not computed, or None: a streamed dataset is only known by reading it through,
    and `skip_prepare_dataset` means TRL does not tokenise it (the figures would describe other data)."""
    import datasets

    if isinstance(train_dataset, datasets.IterableDataset):
        return "the training data is streamed (counted only by reading it all; `sft data` does not stream)"
    if (training_args.dataset_kwargs or {}).get("skip_prepare_dataset"):
        return "`dataset_kwargs.skip_prepare_dataset`: TRL takes the data as it is"
    return None


def for_training(train_dataset, tokenizer, plan) -> Stats | None:
    """The figures training prints at its start (the mix that trains, at the run plan's batch), written by the main
    process to `<output_dir>/data_stats.json`; None where `skipped` says why. Every rank calls it (TRL's preparation
    has barriers)."""
    training_args = plan.training_args
    if skipped(train_dataset, training_args):
        return None
    stats = measure(train_dataset, tokenizer, training_args, "training data")
    check_answers_kept(stats)
    stats = add_packing(stats, train_dataset, tokenizer, training_args, plan.dims.dp, plan.batch)
    if training_args.process_index == 0:
        path = Path(training_args.output_dir) / STATS_FILE
        path.write_text(json.dumps(stats.as_json(), indent=1) + "\n")
    return stats


def main(argv: list[str] | None = None, prog: str = "python -m sft.data.stats") -> int:
    parser = flags.Parser(prog=prog, description=__doc__.splitlines()[0], usage=f"{prog} [--config] RECIPE ...")
    parser.add_argument("--config", required=True, metavar="RECIPE", help="a training recipe (YAML), e.g. "
                        "recipes/demo.yaml; also taken as the first argument")  # fmt: skip
    parser.add_argument("--gpus", type=flags.whole(1), default=1, help="data-parallel processes (1)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    try:
        args, fields = parser.parse_known_args(with_config(sys.argv[1:] if argv is None else argv, prog))
    except SFTError as e:
        parser.error(str(e))
    from sft.config import parse_args
    from sft.core import logs
    from sft.data.load import load_datasets, mix, prepare_source
    from sft.model.build import load_tokenizer

    logs.quiet_accelerator_detection()
    logging.basicConfig(format=logs.LOG_FORMAT, level=logging.WARNING)
    if not logs.is_terminal():  # no progress bars in a log file or pipe (as in training)
        import datasets

        datasets.utils.logging.disable_progress_bar()
    try:
        script_args, data_args, training_args, model_args = parse_args(["--config", args.config, *fields])
        tokenizer = load_tokenizer(model_args, training_args)
        sources = data_args.datasets
        only = bool(training_args.assistant_only_loss)
        text_field = training_args.dataset_text_field
        if sources:
            parts = [prepare_source(s, text_field, False, only) for s in sources]
            per_source = [
                measure(p, tokenizer, training_args, str(s.path)) for s, p in zip(sources, parts, strict=True)
            ]
            train = mix(parts, sources, training_args.seed)
        else:  # `dataset_name`: one source, as training loads it
            train, _ = load_datasets(script_args, data_args, training_args)
            per_source = []
        total = measure(train, tokenizer, training_args, "total (the mix that trains)")
        total = add_packing(total, train, tokenizer, training_args, args.gpus)
    except SFTError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    blocks = [describe(s) for s in per_source] if len(per_source) > 1 else []
    print("\n\n".join([*blocks, describe(total)]))
    if args.json:
        Path(args.json).write_text(json.dumps([s.as_json() for s in [*per_source, total]], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
