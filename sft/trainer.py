"""sft's trainer: TRL's SFTTrainer plus a metrics log that needs no tracker, and an optional data trace."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

from transformers import TrainerCallback
from trl import SFTTrainer

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
DATA_TRACE_DIR = "data_trace"


class MetricsJsonlCallback(TrainerCallback):
    """Append every log event of the main process to `<output_dir>/metrics.jsonl`, one JSON object a line.

    Each line has `step`, `epoch`, a wall-clock `time` and everything the trainer logged at that step (loss,
    learning_rate, grad_norm, num_tokens, mean_token_accuracy, eval metrics, ...). The file is appended to, never
    truncated, so a resumed run continues it.
    """

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, METRICS_FILE)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        record = {"step": state.global_step, "epoch": state.epoch, "time": time.time(), **logs}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class Trainer(SFTTrainer):
    """TRL's `SFTTrainer` with sft's additions; everything else (packing, collation, loss) is TRL's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(MetricsJsonlCallback(self.args.output_dir))

    def training_step(self, model, inputs, num_items_in_batch=None):
        if getattr(self.args, "trace_data", False):
            self._trace_batch(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def _trace_batch(self, inputs) -> None:
        input_ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else input_ids.numel()
        digest = hashlib.sha1(input_ids.detach().cpu().numpy().tobytes()).hexdigest()
        path = os.path.join(self.args.output_dir, DATA_TRACE_DIR, f"rank{self.args.process_index}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"step": self.state.global_step, "tokens": tokens, "sha1": digest}) + "\n")
