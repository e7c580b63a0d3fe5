"""Training FLOPs of a batch and model FLOPs utilisation (MFU) against the GPU's dense bf16 peak.

transformers counts `6 x parameters x tokens` (`total_flos`), which counts the input embedding lookup as a matmul and
leaves attention out. sft counts what the GPU multiplies:

- linear layers (every `nn.Linear`: the decoder's projections and the output head, tied or not; never the input
  embedding, which is a lookup): 2 FLOPs per weight per token forward, 4 backward (input and weight gradients), so 6 x
  in_features x out_features x tokens; a frozen layer (LoRA's base) has no weight gradient: 4 x.
- causal attention per layer, from the real sample lengths of every row (a packed row holds several samples, each
  attending only to itself): forward QK^T and AV cost 2 x len^2 x d each at full, half of that causal, so
  2 x len^2 x d forward and 6 x len^2 x d with the backward, d = attention heads x head dim. Summed over samples:
  sum(len^2), never max_length^2. A layer with a sliding window w counts w^2 / 2 + (len - w) x w pairs instead of
  len^2 / 2 (`sft.model.architectures.Architecture.attention_pairs`).
- mixture-of-experts layers on the active parameters: of the fused experts module (transformers' `<Family>Experts`)
  only `num_experts_per_tok` of `num_experts` experts' weights per token
  (`sft.model.architectures.matmul_flops_per_token`).

MFU = those FLOPs per second per GPU / the GPU's peak. The peak is looked up from the device name (dense bf16 spec,
no sparsity) or given with `peak_tflops`.
"""

from __future__ import annotations

import logging

import torch

from sft.model import architectures

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peak, TFLOP/s, from NVIDIA's data sheets; matched against torch.cuda.get_device_name() in
# this order (the first key contained in the name wins).
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
)


def detect_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name`, or None for a GPU not in the table."""
    for key, peak in PEAK_TFLOPS:
        if key in device_name:
            return peak
    return None


def _architecture(model: torch.nn.Module) -> architectures.Architecture | None:
    try:
        return architectures.of(model.config)
    except AttributeError as e:  # a config without heads or layers
        logger.warning("%s: attention FLOPs are not counted in MFU (%s)", type(model.config).__name__, e)
        return None


def linear_flops_per_token(model: torch.nn.Module) -> int:
    """Training FLOPs per token of the weights a token multiplies: 6 x weights (4 x for a frozen layer), the active
    experts only (`sft.model.architectures.matmul_flops_per_token`)."""
    return architectures.matmul_flops_per_token(model, _architecture(model))


def sample_lengths(inputs: dict) -> torch.Tensor:
    """Length of every sample in a micro-batch: from the packed boundaries, the padding mask, or whole rows."""
    if inputs.get("cu_seq_lens_q") is not None:
        return inputs["cu_seq_lens_q"].diff().long()
    if inputs.get("attention_mask") is not None:
        return inputs["attention_mask"].sum(-1).long()
    rows, seq = inputs["input_ids"].shape
    return torch.full((rows,), seq, dtype=torch.long, device=inputs["input_ids"].device)


class FlopCounter:
    """Training FLOPs of the micro-batches of one rank, kept on the batch's device (no host sync per step)."""

    def __init__(self, model: torch.nn.Module, arch: architectures.Architecture | None = None):
        self.arch = arch if arch is not None else _architecture(model)
        self.per_token = architectures.matmul_flops_per_token(model, self.arch)
        self.layers = self.arch.layers if self.arch else 0
        self.width = self.arch.attention_width if self.arch else 0
        self.pending: torch.Tensor | None = None

    def batch_flops(self, inputs: dict) -> torch.Tensor:
        return self.flops_of(sample_lengths(inputs))

    def flops_of(self, lengths: torch.Tensor) -> torch.Tensor:
        """Training FLOPs of samples of these lengths."""
        lengths = lengths.double()
        attention = 12 * self.width * self.arch.attention_pairs(lengths) if self.arch else 0.0
        return self.per_token * lengths.sum() + attention

    def add(self, inputs: dict, lengths: torch.Tensor | None = None, share: float = 1.0) -> None:
        """Count a micro-batch (or, given `lengths`, samples of those lengths), times `share`."""
        flops = (self.batch_flops(inputs) if lengths is None else self.flops_of(lengths)) * share
        self.pending = flops if self.pending is None else self.pending + flops.to(self.pending.device)

    def take(self, device: torch.device) -> torch.Tensor:
        """This rank's FLOPs since the last call, as a float64 tensor on `device` (to be all-reduced)."""
        pending = self.pending if self.pending is not None else torch.zeros((), dtype=torch.float64)
        self.pending = None
        return pending.to(device)
