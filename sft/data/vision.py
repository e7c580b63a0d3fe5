"""Image+text samples packed into one row exactly (issue #55): each sample's logits in the row equal its logits alone.

A vision-language model packs exactly only where three things hold, and they are family by family:

- **the images are encoded within their own boundaries**: Qwen2-VL, Qwen2.5-VL and Qwen3-VL encode all the images of
  a batch as one sequence of patches, each image attending only to itself (`cu_seqlens` from `image_grid_thw`, and
  Qwen2.5-VL's windows inside each image), so the images of several samples are encoded as they would be alone;
- **the positions are each sample's own**: these families rotate by 3-D positions (M-RoPE: temporal, height, width
  for image tokens; the three equal for text), offset by what came before in the sample. They are computed per sample
  by the model's own `get_rope_index` and concatenated;
- **no token attends across samples**: transformers' text model takes a fourth, first row of positions (0..n-1 within
  each sample) as the sample boundaries (the packed-sequence mask of eager/sdpa; the varlen kernels' `cu_seqlens`).
  Without that row the samples attend to each other (`tests/test_vision_packing.py` measures the leak).

Each sample's first label is masked (-100): the token before it is the previous sample's last.

Other families are refused here with the reason (`check`): Gemma 3's image tokens attend to each other both ways
(`token_type_ids`), which the packed-sequence mask does not express; Idefics3/SmolVLM and video inputs are not yet
checked against one-by-one runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sft.errors import ConfigError

MROPE = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
NOT_PACKED = {
    "gemma3": "its image tokens attend to each other in both directions (`token_type_ids`), which the packed-sequence "
    "mask cannot express",
    "idefics3": "not yet checked against one-by-one runs",
    "smolvlm": "not yet checked against one-by-one runs",
}
IGNORE = -100


def check(config) -> None:
    """Refuse, before any work, to pack image+text samples for a family that is not packed exactly."""
    family = config.model_type
    if family in MROPE:
        return
    why = NOT_PACKED.get(family, "not a vision-language family sft packs")
    raise ConfigError(
        f"`packing: true` with image+text samples for `{family}`: {why}. Packed families: {', '.join(sorted(MROPE))}. "
        "Set `packing: false` to train this model on padded batches."
    )


@dataclass(frozen=True)
class Sample:
    """One chat as the model's processor made it: token ids and labels (1-D), and its images' patches with their
    (temporal, height, width) grids, or none."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


class MRopePacker:
    """Packs samples of an M-RoPE family into one row: the model's inputs for `forward` (batch of one)."""

    def __init__(self, model: torch.nn.Module):
        check(model.config)
        self.image_token_id = model.config.image_token_id
        inner = getattr(model, "model", model)
        self._rope_index = inner.get_rope_index  # a function of the config and the ids; no weights read

    def positions(self, sample: Sample) -> torch.Tensor:
        """The sample's rotary positions alone, shape [3, n]."""
        ids = sample.input_ids
        if sample.image_grid_thw is None:
            return torch.arange(len(ids)).expand(3, -1)
        types = (ids == self.image_token_id).int()[None]
        position_ids, _ = self._rope_index(ids[None], mm_token_type_ids=types, image_grid_thw=sample.image_grid_thw)
        return position_ids[:, 0]

    def __call__(self, samples: list[Sample]) -> dict:
        labels = []
        for sample in samples:
            label = sample.labels.clone()
            label[0] = IGNORE  # predicted from the previous sample's last token
            labels.append(label)
        text = torch.cat([torch.arange(len(s.input_ids)) for s in samples])
        rotary = torch.cat([self.positions(s) for s in samples], dim=-1)
        batch = {
            "input_ids": torch.cat([s.input_ids for s in samples])[None],
            "labels": torch.cat(labels)[None],
            "position_ids": torch.cat([text[None], rotary])[:, None],  # [4, 1, tokens]: boundaries, then M-RoPE
        }
        images = [s for s in samples if s.pixel_values is not None]
        if images:
            batch["pixel_values"] = torch.cat([s.pixel_values for s in images])
            batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in images])
        return batch
