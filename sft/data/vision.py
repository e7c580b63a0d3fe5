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

The records are TRL's vision format: chat `messages` whose `content` is a list of parts (`{"type": "image"}` where an
image goes, `{"type": "text", "text": ...}`), and an `images` list in the order of the image parts: local paths
(relative to the data file's folder), `{"bytes": ...}` as a datasets `Image` column stores them in parquet, or PIL
images. `check_record` names what is wrong with a record (a missing or unreadable image, a count of image parts that
does not match the images) before any training, as `sft.data.load` does for text.

Other families are refused here with the reason (`check`): Gemma 3's image tokens attend to each other both ways
(`token_type_ids`), which the packed-sequence mask does not express; Idefics3/SmolVLM and video inputs are not yet
checked against one-by-one runs.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch

from sft.errors import ConfigError, DataError

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


def image_parts(messages) -> int | str:
    """The number of image parts in a chat, or what is wrong with its shape."""
    if not isinstance(messages, list) or not messages:
        return "`messages` must be a non-empty list of turns"
    count = 0
    for i, turn in enumerate(messages):
        content = turn.get("content") if isinstance(turn, dict) else None
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            return f"`messages[{i}].content` must be a string or a list of parts, got {type(content).__name__}"
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image", "text"):
                parts = '{"type": "image"} or {"type": "text", "text": ...}'
                return f"`messages[{i}].content[{j}]` must be {parts}, got {part!r}"
            count += kind == "image"
    return count


def open_image(image, base: Path):
    """A record's image as a PIL image: a path (relative to `base`), `{"bytes": ...}` or a PIL image."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, dict) and image.get("bytes") is not None:
        return Image.open(io.BytesIO(image["bytes"]))
    path = image.get("path") if isinstance(image, dict) else image
    if not isinstance(path, str):
        raise TypeError(f"an image must be a path, {{'bytes': ...}} or a PIL image, got {type(image).__name__}")
    path = Path(path) if Path(path).is_absolute() else base / path
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    return Image.open(path)


def check_record(record: dict, base: Path) -> str | None:
    """What is wrong with one image+text record, or None: its chat's shape, the image parts against `images`, and
    whether each image opens and decodes."""
    count = image_parts(record.get("messages"))
    if isinstance(count, str):
        return count
    images = record.get("images") or []
    if not isinstance(images, list):
        return f"`images` must be a list, got {type(images).__name__}"
    if count != len(images):
        return (f"{count} image part(s) in `messages` but {len(images)} image(s) in `images`: each "
                '{"type": "image"} part takes the next image, in order')  # fmt: skip
    for k, image in enumerate(images):
        try:
            opened = open_image(image, base)
            opened.load()  # decodes: a truncated or corrupt file fails here, not in a data-loader worker
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds; each is this record's unreadable image
            shown = image if isinstance(image, str) else type(image).__name__
            return f"`images[{k}]` ({shown}) cannot be read as an image: {e}"
    return None


def check_records(records, source: Path) -> None:
    """Every record of the data file `source` checked up front: the first bad one is a DataError naming it."""
    for i, record in enumerate(records):
        problem = check_record(record, source.parent)
        if problem:
            raise DataError(f"{source}: record {i}: {problem}. Fix or drop that record.")


def encode(record: dict, tokenizer, image_processor, base: Path, image_token: str = "<|image_pad|>") -> Sample:
    """One checked record as its model sees it: the chat rendered by the tokenizer's template (an image part becomes
    one `image_token` between the vision start/end tokens), each image's token repeated once per merged patch group as
    the family's processor does (`image_grid_thw` product / merge_size**2), labels on the assistant's tokens only (the
    template's `{% generation %}` markers)."""
    rendered = tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)  # fmt: skip
    ids, trained = rendered["input_ids"], rendered["assistant_masks"]
    if not any(trained):
        raise DataError("the chat template marks no assistant tokens (`{% generation %}`): nothing would be trained")
    images = [open_image(x, base).convert("RGB") for x in record.get("images") or []]
    if not images:
        ids_t = torch.tensor(ids)
        return Sample(ids_t, torch.where(torch.tensor(trained, dtype=torch.bool), ids_t, IGNORE))
    processed = image_processor(images=images, return_tensors="pt")
    grid = processed["image_grid_thw"]
    counts = iter((grid.prod(-1) // image_processor.merge_size**2).tolist())
    pad = tokenizer.convert_tokens_to_ids(image_token)
    out_ids, out_trained = [], []
    for token, on in zip(ids, trained, strict=True):
        repeat = next(counts) if token == pad else 1
        out_ids += [token] * repeat
        out_trained += [on and token != pad] * repeat
    ids_t = torch.tensor(out_ids)
    labels = torch.where(torch.tensor(out_trained, dtype=torch.bool), ids_t, IGNORE)
    return Sample(ids_t, labels, processed["pixel_values"], grid)


def rows(lengths: list[int], max_length: int) -> list[list[int]]:
    """Sample indices packed into rows of at most `max_length` tokens, best fit decreasing (TRL's `bfd` for text): the
    longest sample first, each into the fullest row it fits. A pure function of the lengths: the same rows on every
    rank and on every resume."""
    too_long = next((i for i, n in enumerate(lengths) if n > max_length), None)
    if too_long is not None:
        raise DataError(
            f"record {too_long}: {lengths[too_long]} tokens with its image tokens, over `max_length: {max_length}`; "
            "an image+text sample is never cut (its image tokens would lose their image). Raise `max_length`, make "
            "its images smaller (the image processor's `max_pixels`) or drop the record."
        )
    packed: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [r for r, free in enumerate(space) if free >= lengths[i]]
        if fits:
            best = min(fits, key=lambda r: (space[r], r))
            packed[best].append(i)
            space[best] -= lengths[i]
        else:
            packed.append([i])
            space.append(max_length - lengths[i])
    return packed


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
