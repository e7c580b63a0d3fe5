"""Training FLOPs of a batch and model FLOPs utilisation (MFU) against the GPU's dense bf16 peak.

transformers counts `6 x parameters x tokens` (`total_flos`), which counts the input embedding lookup as a matmul and
leaves attention out. sft counts what the GPU multiplies:

- linear layers (every `nn.Linear`: the decoder's projections and the output head, tied or not; never the input
  embedding, which is a lookup): 2 FLOPs per weight per token forward, 4 backward (input and weight gradients), so 6 x
  in_features x out_features x tokens; a frozen layer (LoRA's base) has no weight gradient: 4 x.
- causal attention per layer, from the real sample lengths of every row (a packed row holds several samples, each
  attending only to itself): forward QK^T and AV cost 2 x len^2 x d each at full, half of that causal, so
  2 x len^2 x d forward and 6 x len^2 x d with the backward, d = attention heads x head dim. Summed over samples:
  sum(len^2), never max_length^2.

Mixture-of-experts layers are counted with every expert, not the active ones, so MFU of a MoE model is overstated.

MFU = those FLOPs per second per GPU / the GPU's peak. The peak is looked up from the device name (dense bf16 spec,
no sparsity) or given with `peak_tflops`.
"""

from __future__ import annotations

import logging

import torch

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


def attention_width(config) -> tuple[int, int]:
    """(decoder layers, attention heads x head dim) from a transformers model config; (0, 0) if it names neither."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, layers = getattr(text, "num_attention_heads", None), getattr(text, "num_hidden_layers", None)
    if not heads or not layers:
        logger.warning("%s names no attention heads or layers: attention FLOPs are not counted in MFU", type(config))
        return 0, 0
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return layers, heads * head_dim


def linear_flops_per_token(model: torch.nn.Module) -> int:
    """Training FLOPs per token of every linear layer: 6 x weights (4 x for a frozen layer).

    in_features x out_features, not `weight.numel()`: under ZeRO-3 a rank holds a slice of each weight and 4-bit
    weights are packed.
    """
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weights = module.in_features * module.out_features
            total += (6 if module.weight.requires_grad else 4) * weights
    return total


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

    def __init__(self, model: torch.nn.Module):
        self.per_token = linear_flops_per_token(model)
        self.layers, self.width = attention_width(model.config)
        self.pending: torch.Tensor | None = None

    def batch_flops(self, inputs: dict) -> torch.Tensor:
        return self.flops_of(sample_lengths(inputs))

    def flops_of(self, lengths: torch.Tensor) -> torch.Tensor:
        """Training FLOPs of samples of these lengths."""
        lengths = lengths.double()
        return self.per_token * lengths.sum() + 6 * self.layers * self.width * (lengths * lengths).sum()

    def add(self, inputs: dict, lengths: torch.Tensor | None = None, share: float = 1.0) -> None:
        """Count a micro-batch (or, given `lengths`, samples of those lengths), times `share`."""
        flops = (self.batch_flops(inputs) if lengths is None else self.flops_of(lengths)) * share
        self.pending = flops if self.pending is None else self.pending + flops.to(self.pending.device)

    def take(self, device: torch.device) -> torch.Tensor:
        """This rank's FLOPs since the last call, as a float64 tensor on `device` (to be all-reduced)."""
        pending = self.pending if self.pending is not None else torch.zeros((), dtype=torch.float64)
        self.pending = None
        return pending.to(device)
