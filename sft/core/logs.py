"""What a run prints: log levels per rank, known-harmless library warnings, progress bars or plain lines.

One owner for the console, called once by `sft.train` right after the arguments are parsed (`setup`):

- sft's own messages at info from the main process, errors only from the others; transformers' and datasets'
  loggers at the levels the training arguments give (`log_level`, `log_level_replica`);
- the other ranks' standard output (DeepSpeed's bare `print`s) goes to /dev/null unless `log_level_replica` is
  `info` or `debug`; their standard error (warnings, errors, tracebacks) stays;
- warnings that torch raises on every call of a collective DeepSpeed makes (`reduce_scatter_tensor`,
  `all_gather_into_tensor` "is deprecated": 8,300 lines in a 60-step ZeRO-3 demo) are filtered, with one line
  saying so (`HARMLESS_WARNINGS`); two harmless messages that other libraries log on GPUs, one with a traceback per
  Triton kernel, are dropped (`QUIET_MESSAGES`);
- without a terminal (a log file, CI, a pipe) there are no progress bars, which there write carriage returns and
  cursor-up escape codes; each training log is one plain line instead (transformers' `disable_tqdm`).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

logger = logging.getLogger("sft")

# (category, message regex): warnings raised inside torch/DeepSpeed on every call, about code that is not sft's
HARMLESS_WARNINGS = (
    # torch 2.13 deprecates the `*_tensor` collectives that DeepSpeed's ZeRO-2/3 call on every step and save
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),
    # TRL 1.16's SFTTrainer deprecates `use_liger_kernel` for the Hub kernels (`use_kernels`), on every run with Liger
    # on. The Hub kernels are downloaded from the Hugging Face Hub when the model loads, which clusters without
    # network access cannot do; sft keeps liger-kernel (a pip package, offline), on per family where measured faster
    # (sft.model.architectures). Nothing in the warning is the user's to act on.
    (FutureWarning, r"`use_liger_kernel=True` is deprecated"),
    # torch's barrier, called by accelerate and DeepSpeed in a group made without `device_id` (one process without a
    # launcher, measured on 1 x H200: benchmarks/results/one_process): it uses the current GPU, the one sft set
    (UserWarning, r"barrier\(\): using the device under current context"),
    # PEFT 0.21 reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model (every LoRA run)
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)
# messages of other libraries that are harmless, with tracebacks, printed at WARNING: (logger, message start) dropped
# by a filter on that logger (measured on the GPU machine, benchmarks/results/fp8/call4_8b_2gpu: 7,292 log lines for a
# 7-step compiled FP8 run, 49 for bf16)
QUIET_MESSAGES = (
    # torch.compile reading Liger's Triton kernels: "Encountered an exception in identify_mutated_tensors [torch 2.11;
    # identify_accessed_tensors in 2.13], assuming every input is mutated" and a 25-line traceback, per kernel and
    # rank (the kernel then runs as it is). The logger is all of dynamo's, whose other warnings stay.
    ("torch._dynamo", "Encountered an exception in identify_"),
    # Liger's optional backends (CuTe DSL, Ascend) that are not installed: "Backend impl ... could not be imported"
    ("liger_kernel.backends.registry", "Backend impl"),
)


class _DropMessages(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def is_terminal() -> bool:
    return sys.stderr.isatty()


def setup(training_args) -> None:
    """Levels, per-rank output, harmless warnings and progress display for this process (see the module doc)."""
    import datasets
    import transformers

    main = training_args.process_index == 0
    level = training_args.get_process_log_level()
    logging.basicConfig(format=LOG_FORMAT, level=level, force=True)
    logger.setLevel(logging.INFO if main else logging.ERROR)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, start in QUIET_MESSAGES:
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.start == start for f in target.filters):
            target.addFilter(_DropMessages(start))
    if not main and level > logging.INFO:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout from here on)
    if not main or not is_terminal():
        datasets.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    if not is_terminal():
        training_args.disable_tqdm = True  # transformers prints each log as one line instead of a progress bar


def quiet_accelerator_detection() -> None:
    """Without a GPU, tell DeepSpeed it is the CPU before it looks: otherwise every process that imports it warns
    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
