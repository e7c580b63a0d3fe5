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
  len^2 / 2 (`sft.model.architectures.Architecture.attention_pairs`); a layer whose head dim differs from the mean
  (Gemma 4) in proportion; a linear-attention layer (Qwen3.5's Gated DeltaNet) none: its projections are linear
  layers, its recurrence (linear in the length) is not counted.
- mixture-of-experts layers on the active parameters: of the fused experts module (transformers' `<Family>Experts`)
  only `num_experts_per_tok` of `num_experts` experts' weights per token
  (`sft.model.architectures.matmul_flops_per_token`).

- a vision-language model's encoder (`VisionFlops`), per image from `image_grid_thw` (Gemma 3: per image of
  `pixel_values`, all one size): its linear layers and patch embedding per patch, its projector per merged token,
  attention both ways within each image (within each window in Qwen2.5-VL's windowed layers); forward only (2 x)
  while the encoder is frozen. The image tokens the projector hands the language model are tokens of their sample
  like any other, counted causally (Gemma 3's image tokens attend to each other both ways: half an image's pairs more
  per layer, not counted).

MFU = those FLOPs per second per GPU / the GPU's peak. The peak is looked up from the device name (dense bf16 spec,
no sparsity) or given with `peak_tflops`.
"""

from __future__ import annotations

import logging
import math

import torch

from sft.model import architectures
from sft.model.attention import boundaries_from_positions

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
    """Length of every sample in a micro-batch: from the packed boundaries, the padding mask, the positions (a
    sample starts at 0: an image+text row of `sft.data.vision`), or whole rows."""
    if inputs.get("cu_seq_lens_q") is not None:
        return inputs["cu_seq_lens_q"].diff().long()
    if inputs.get("attention_mask") is not None:
        return inputs["attention_mask"].sum(-1).long()
    if inputs.get("position_ids") is not None and inputs["position_ids"].dim() == 2:
        return boundaries_from_positions(inputs["position_ids"]).diff().long()
    rows, seq = inputs["input_ids"].shape
    return torch.full((rows,), seq, dtype=torch.long, device=inputs["input_ids"].device)


class VisionFlops:
    """Training FLOPs of a vision-language model's encoder (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, SmolVLM, Idefics3)
    for a batch's images.

    Per patch, every linear layer and the patch embedding (a convolution whose stride is its kernel: one matmul per
    patch) of the encoder; per merged token (Qwen-VL: `spatial_merge_size`^2 patches; Gemma 3: `mm_tokens_per_image`
    an image, pooled from its patches; SmolVLM, Idefics3: `scale_factor`^2 patches of a tile), the projectors
    (`merger`, Qwen3-VL's deepstack mergers, Gemma 3's `multi_modal_projector`, SmolVLM's `connector`). 2 x weights
    forward; 6 x where the encoder trains (a frozen weight under a trained one: 4 x); a trained projector over a
    frozen encoder 4 x (no input gradient below it: the smaller count); Gemma 4: its patches pooled
    `pooling_kernel_size`^2 into a token by a matmul (2 x width x patches x tokens forward), projected by
    `embed_vision`, counted over each image's own patches (not its padding to `max_soft_tokens`). Attention
    both ways, 4 x width x pairs forward (12 x where the encoder trains), pairs of patches within each frame of an
    image, and in Qwen2.5-VL's windowed layers within each window of `window_size` pixels. Gemma 3's images and
    SmolVLM's tiles are all one size (`image_size`), counted from the batch's `pixel_values`."""

    def __init__(self, model: torch.nn.Module, encoder: torch.nn.Module):
        config = model.config.vision_config
        trains = any(p.requires_grad for n, p in encoder.named_parameters() if "merger" not in n)
        self.per_patch = self.per_merged = 0.0
        for name, module in encoder.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, (torch.nn.Linear, torch.nn.Conv3d, torch.nn.Conv2d)) or weight is None:
                continue
            size = math.prod(architectures._shape(weight))
            if "merger" in name:
                self.per_merged += (6 if trains else 4 if weight.requires_grad else 2) * size
            else:
                self.per_patch += (6 if weight.requires_grad else 4 if trains else 2) * size
        projector = architectures.vision_projector(model)  # Gemma 3's, beside the encoder: its matrices
        for weight in projector.parameters() if projector is not None else ():
            if len(architectures._shape(weight)) == 2:
                self.per_merged += (6 if trains else 4 if weight.requires_grad else 2) * math.prod(
                    architectures._shape(weight))  # fmt: skip
        self.merge = getattr(config, "spatial_merge_size", None) or 1
        # Gemma 3: every image `side` x `side` patches, pooled into mm_tokens_per_image tokens; SmolVLM, Idefics3:
        # every tile `side` x `side` patches, shuffled into 1 / scale_factor^2 as many; Qwen-VL: from the grids;
        # Gemma 4: each image its own patches (`image_position_ids`), pooled pooling_kernel_size^2 into a token
        pool = getattr(config, "pooling_kernel_size", None)
        self.side = config.image_size // config.patch_size if projector is not None and not pool else 0
        tokens = getattr(model.config, "mm_tokens_per_image", None)
        scale = getattr(model.config, "scale_factor", None) or self.merge
        self.merged_per_patch = 1 / pool**2 if pool else tokens / self.side**2 if tokens else 1 / scale**2
        self.pooling = (6 if trains else 2) if pool else 0  # Gemma 4 averages by a matmul: tokens x patches x width
        self.width = getattr(config, "embed_dim", None) or config.hidden_size
        self.attention = 12 if trains else 4
        layers = getattr(config, "depth", None) or config.num_hidden_layers
        windowed = getattr(config, "window_size", None) and getattr(config, "fullatt_block_indexes", None) is not None
        self.full_layers = len(config.fullatt_block_indexes) if windowed else layers
        self.window_layers = layers - self.full_layers
        # Qwen2.5-VL's windows, in merged tokens per side
        self.window = config.window_size // self.merge // config.patch_size if windowed else 0

    def grids(self, inputs: dict) -> torch.Tensor | None:
        """The (frames, height, width) patch grid of every image of a batch, or None without images."""
        if inputs.get("image_grid_thw") is not None:
            return inputs["image_grid_thw"]
        if inputs.get("image_position_ids") is not None:  # Gemma 4: each image's patch columns and rows, -1 padding
            sides = inputs["image_position_ids"].amax(dim=1) + 1
            return torch.cat([torch.ones_like(sides[:, :1]), sides], dim=-1)
        pixels = inputs.get("pixel_values")
        if not self.side or pixels is None:
            return None
        return torch.tensor([1, self.side, self.side]).expand(pixels.shape[:-3].numel(), 3)  # images (or tiles)

    def _window_pairs(self, frames: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Patch pairs within the windows of frames of h x w patches: windows of `window` merged tokens per side,
        the last one on each side shorter; each frame's pairs are merge^4 x sum(rows^2) x sum(columns^2)."""

        def squares(n: torch.Tensor) -> torch.Tensor:  # sum of the squared window sizes cutting n merged tokens
            full, rest = n // self.window, n % self.window
            return full * self.window**2 + rest * rest

        merged_h, merged_w = h // self.merge, w // self.merge
        return frames * self.merge**4 * squares(merged_h) * squares(merged_w)

    def flops(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """FLOPs for images of these (frames, height, width) patch grids."""
        grid = grid_thw.double()
        frames, h, w = grid.unbind(-1)
        patches = frames * h * w
        pairs = self.full_layers * frames * (h * w) ** 2
        if self.window_layers:
            pairs = pairs + self.window_layers * self._window_pairs(*grid_thw.long().unbind(-1)).double()
        linear = self.per_patch * patches + self.per_merged * patches * self.merged_per_patch
        linear = linear + self.pooling * self.width * patches * patches * self.merged_per_patch
        return (linear + self.attention * self.width * pairs).sum()


class FlopCounter:
    """Training FLOPs of the micro-batches of one rank, kept on the batch's device (no host sync per step)."""

    def __init__(self, model: torch.nn.Module, arch: architectures.Architecture | None = None):
        self.arch = arch if arch is not None else _architecture(model)
        self.per_token = architectures.matmul_flops_per_token(model, self.arch)
        self.layers = self.arch.layers if self.arch else 0
        self.width = self.arch.attention_width if self.arch else 0
        encoder = architectures.vision_encoder(model)
        self.vision = VisionFlops(model, encoder) if encoder is not None else None
        self.pending: torch.Tensor | None = None

    def batch_flops(self, inputs: dict) -> torch.Tensor:
        flops = self.flops_of(sample_lengths(inputs))
        grids = self.vision.grids(inputs) if self.vision is not None else None
        if grids is not None:
            flops = flops + self.vision.flops(grids).to(flops.device)
        return flops

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
