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
  Without that row the samples attend to each other (`tests/test_vision_packing.py` measures the leak). A packed
  batch carries that row as `position_ids` ([1, tokens], what TRL and sft count tokens and samples by) and the three
  M-RoPE rows as `mrope_position_ids`; `sft.model.vision_hooks.join_positions` (a forward pre-hook the run plan
  puts on the model) stacks them into the [4, 1, tokens] positions the model reads.

Each sample's first label is masked (-100): the token before it is the previous sample's last.

The records are TRL's vision format: chat `messages` whose `content` is a list of parts (`{"type": "image"}` where an
image goes, `{"type": "text", "text": ...}`), and an `images` list in the order of the image parts: local paths
(relative to the data file's folder), `{"bytes": ...}` as a datasets `Image` column stores them in parquet, or PIL
images. `check_record` names what is wrong with a record (a missing or unreadable image, a count of image parts that
does not match the images) before any training, as `sft.data.load` does for text.

Gemma 3 packs exactly by masks instead (`BlockMaskPacker`, `sft.model.vision_hooks.block_masks`): its positions are 1-D
and restart at each sample, its images are encoded one by one (all one size), but its image tokens attend to each other
both ways (`token_type_ids`), and transformers' own Gemma 3 masks let a packed row's samples see each other (measured:
a packed row with each sample's positions restarting, through eager and sdpa, logits up to 0.39 off its samples alone
from the second sample on; transformers 5.24). sft builds the masks each sample has alone, per layer type (sliding
window or full), on the model's device at every forward, and the run takes sdpa (or eager), which read them. Gemma 3's
checkpoints train on text too: a run of a `gemma3` config is image+text where its data's records hold images
(`sources_have_images`), a text run otherwise.

Gemma 4 packs the same way, by sft's masks (`mm_token_type_ids`), with two differences its model has: an image's
tokens attend to each other both ways only in the sliding-window layers (its full layers are causal), and only where
its text config says `use_bidirectional_attention: vision`; and its images come in their own sizes (patches padded to
the processor's `max_soft_tokens`, encoded one image per batch entry). transformers' own masks let its packed samples
see each other too (measured: tests/test_vision_packing.py).

SmolVLM and Idefics3 pack by positions (`TiledPacker`): their text model is a Llama (1-D positions restarting at each
sample keep packed samples apart, as for text), their encoder takes each tile of an image alone (all one size), and a
record's image part becomes its processor's prompt of that image's tiles (`Images`).

Other families are refused here, named (`check`); video inputs are not built.
"""

from __future__ import annotations

import bisect
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from sft.errors import ConfigError, DataError
from sft.model.architectures import VISION

logger = logging.getLogger(__name__)

IGNORE = -100


class Plan(NamedTuple):
    """The run plan's line for an image+text run (`RunPlan.vision`)."""

    assistant_only: bool  # labels on the assistant's tokens only (`assistant_only_loss`), else on every text token
    train_tower: bool  # the vision encoder trains too (`train_vision_tower`); else frozen, its projector trained
    packing: str = "mrope"  # how rows keep samples apart: "mrope" (M-RoPE rows and a boundary row), "masks" (sft's
    # attention masks: Gemma 3) or "positions" (1-D positions restarting: SmolVLM, Idefics3)


def check(config) -> None:
    """Refuse, before any work, a vision-language family sft does not pack exactly (sft builds no padded batches of
    images: `preflight` refuses `packing: false` for these models)."""
    family = config.model_type
    if family in VISION:
        return
    raise ConfigError(
        f"Image+text training of `{family}`: sft trains vision-language models on packed rows only, and not a "
        "vision-language family sft packs. "
        f"Families sft trains: {', '.join(sorted(VISION))}. For this one, use TRL's SFTTrainer on "
        "padded batches."
    )


def mask_attention(requested: str | None, config) -> str:
    """The attention backend of an image+text run packed with sft's masks (`block_masks`): sdpa or eager, which read a
    mask; varlen and flash backends take only sample boundaries and would drop the images' attention both ways."""
    if requested in (None, "auto"):
        logger.info("Attention backend: sdpa (image+text rows of %s carry sft's attention masks: each sample's "
                    "tokens causally, its images both ways where its own masks have them)",
                    config.model_type)  # fmt: skip
        return "sdpa"
    if requested not in ("sdpa", "eager"):
        raise ConfigError(
            f"`attn_implementation: {requested}` with image+text `{config.model_type}`: its packed rows keep samples "
            "apart and let each image attend to itself both ways by sft's own attention masks, which only `sdpa` and "
            "`eager` read. Use `auto` (sdpa) or `eager`."
        )
    return requested


def sources_have_images(sources) -> bool:
    """Whether the data's records hold images: an `images` column with an image in the first record of a source (a
    local file or `save_to_disk` folder; others are not opened here). What makes a run of a config that trains on
    text too (`IMAGE_DATA_FAMILIES`) an image+text run."""
    from sft.data.load import load_source

    for source in sources or []:
        if not Path(source.path).exists():
            continue
        records = load_source(source)
        if "images" in records.column_names and len(records) and records[0]["images"]:
            return True
    return False


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


def check_record(record: dict, base: Path, assistant_only: bool = True) -> str | None:
    """What is wrong with one image+text record, or None: its chat's shape, an assistant turn where only those train,
    the image parts against `images`, and whether each image opens and decodes."""
    count = image_parts(record.get("messages"))
    if isinstance(count, str):
        return count
    if assistant_only and not any(m.get("role") == "assistant" for m in record["messages"]):
        return ("its chat has no assistant turn, and only assistant turns train (`assistant_only_loss`): nothing of "
                "it would be trained")  # fmt: skip
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


def check_records(records, source: Path, assistant_only: bool = True) -> None:
    """Every record of the data file `source` checked up front: the first bad one is a DataError naming it."""
    for i, record in enumerate(records):
        problem = check_record(record, source.parent, assistant_only)
        if problem:
            raise DataError(f"{source}: record {i}: {problem}. Fix or drop that record.")


def _template(record: dict, tokenizer, assistant_only: bool) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """The chat rendered by the tokenizer's template: token ids, which of them train (the template's
    `{% generation %}` markers, or every token with `assistant_only` false), and each token's characters in the
    rendered text."""
    rendered = tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True,
                                             tokenizer_kwargs={"return_offsets_mapping": True})  # fmt: skip
    ids, trained = rendered["input_ids"], rendered["assistant_masks"]
    if not assistant_only:
        trained = [1] * len(ids)
    elif not any(trained):
        raise DataError("the chat template marks no assistant tokens (`{% generation %}`): nothing would be trained")
    return ids, trained, rendered["offset_mapping"]


def expand_images(ids: list[int], trained: list[int], images: list[list[int]], placeholder: int):
    """Each image's placeholder token (the one the chat template writes for an image part) replaced by the tokens the
    model reads for that image (`images`, in order), as the family's processor does; image tokens never train."""
    images = iter(images)
    out_ids, out_trained = [], []
    for token, on in zip(ids, trained, strict=True):
        tokens = next(images) if token == placeholder else [token]
        out_ids += tokens
        out_trained += [int(on and token != placeholder)] * len(tokens)
    return out_ids, out_trained


def image_tokens(image_processor, width: int, height: int) -> int:
    """The image tokens of a `width` x `height` image for Qwen-VL's processor: its patches for that size (after its
    resizing), one token per `merge_size`^2 of them. From the size alone: no pixel is processed."""
    patches = image_processor.get_number_of_image_patches(height, width, {})
    return patches // image_processor.merge_size**2


def framed_tokens(image_processor, width: int, height: int) -> int:
    """The image tokens of a `width` x `height` image for Gemma 4's processor: its patches after the resize that keeps
    the aspect ratio within `max_soft_tokens` (transformers' `get_aspect_ratio_preserving_size`), one token per
    `pooling_kernel_size`^2 of them. From the size alone: no pixel is processed."""
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

    patch, pool = image_processor.patch_size, image_processor.pooling_kernel_size
    side_h, side_w = get_aspect_ratio_preserving_size(height, width, patch, image_processor.max_soft_tokens * pool**2,
                                                      pool)  # fmt: skip
    return (side_h // patch) * (side_w // patch) // pool**2


class Images:
    """How a family's chat turns an image part into the tokens and pixels its model reads, as its processor does.

    - Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the template writes `<|image_pad|>` (between its vision start and end tokens),
      repeated once per merged patch group of that image (its size decides: `image_tokens`); the pixels are patches
      with their grids (`image_grid_thw`).
    - Gemma 3: the template writes `<start_of_image>`, which becomes `\\n\\n<start_of_image>`, `mm_tokens_per_image`
      soft image tokens, `<end_of_image>\\n\\n` (Gemma3Processor's `full_image_sequence`) in the rendered text, and the
      whole text is tokenized as the processor does (its newlines merge with the text's beside them:
      `_expanded_template`); every image is resized to one size. Pan-and-scan crops are not built (refused).
    - Gemma 4: the template writes its image token, which becomes the begin-of-image token, the image's soft tokens
      (their count from its size: `framed_tokens`) and the end-of-image token (Gemma4Processor's
      `replace_image_token`; special tokens, so nothing merges with the text beside them); the pixels are each
      image's patches padded to one length, with their positions (`image_position_ids`).
    - SmolVLM, Idefics3: the template writes `<image>`, which becomes the processor's prompt of that image's tiles
      (`get_image_prompt_string`: per tile `<fake_token_around_image><row_r_col_c>` and `image_seq_len` image tokens,
      then the global image), its rows and columns from the image's size (`get_number_of_image_patches`); the pixels
      are the tiles, all of the encoder's size. The prompt begins and ends with special tokens, so it tokenizes alone
      as in its text."""

    def __init__(self, config, tokenizer, image_processor):
        self.processor, self.tokenizer = image_processor, tokenizer
        self.family = config.model_type
        self.vision = VISION[self.family]
        self.text = None
        if self.vision.text_expansion:
            if getattr(image_processor, "do_pan_and_scan", None):
                raise ConfigError(f"`do_pan_and_scan: true` in the image processor of `{self.family}`: sft builds one "
                                  "image per image part, not pan-and-scan crops. Set it false in "
                                  "preprocessor_config.json.")  # fmt: skip
            self.placeholder = config.boi_token_index
            self.image_ids = {config.boi_token_index, config.image_token_id, config.eoi_token_index}
            boi, image, eoi = tokenizer.convert_ids_to_tokens([config.boi_token_index, config.image_token_id,
                                                               config.eoi_token_index])  # fmt: skip
            self.text = boi, f"\n\n{boi}{image * config.mm_tokens_per_image}{eoi}\n\n"  # placeholder, its expansion
        else:
            self.placeholder = config.image_token_id
        if self.vision.framed:
            if getattr(config, "vision_config", None) is None:
                raise ConfigError(f"`{self.family}` config without a `vision_config`: this checkpoint has no image "
                                  "encoder, so its image records cannot train. Train it on text records.")  # fmt: skip
            self.frame = config.boi_token_id, config.eoi_token_id
        if self.vision.tiles:
            encoder = config.vision_config
            self.seq_len = (encoder.image_size // encoder.patch_size) ** 2 // config.scale_factor**2

    def tokens(self, width: int, height: int) -> list[int]:
        """The tokens the model reads for an image of this size (Gemma 3's: from its text, `_expanded_template`)."""
        if self.vision.tiles:
            from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

            _, rows, cols = self.processor.get_number_of_image_patches(height, width, {})
            image = self.tokenizer.convert_ids_to_tokens(self.placeholder)
            prompt = get_image_prompt_string(rows, cols, self.seq_len, "<fake_token_around_image>", image,
                                             "<global-img>")  # fmt: skip
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if self.vision.framed:
            return self._framed(framed_tokens(self.processor, width, height))
        return [self.placeholder] * image_tokens(self.processor, width, height)

    def _framed(self, n: int) -> list[int]:
        """Gemma 4's tokens of an image of `n` soft tokens: begin, `n` image tokens, end (Gemma4Processor's
        `replace_image_token`)."""
        return [self.frame[0], *[self.placeholder] * n, self.frame[1]]

    def process(self, images: list) -> tuple[dict, list[list[int]]]:
        """The processor's pixels of these (RGB) images as `Sample` fields (Qwen-VL: with their grids; SmolVLM and
        Idefics3: every image's tiles, with their pixel mask), and each image's tokens."""
        if self.vision.tiles:
            processed = [self.processor(images=[[image]], return_tensors="pt") for image in images]
            fields = {key: torch.cat([p[key][0] for p in processed])
                      for key in ("pixel_values", "pixel_attention_mask")}  # fmt: skip
            return fields, [self.tokens(*image.size) for image in images]
        processed = self.processor(images=images, return_tensors="pt")
        if self.vision.framed:  # Gemma 4: every image's patches padded to one length, with their 2-D positions
            fields = {key: processed[key] for key in ("pixel_values", "image_position_ids")}
            return fields, [self._framed(int(n)) for n in processed["num_soft_tokens_per_image"]]
        grid = processed.get("image_grid_thw")
        if grid is None:
            return {"pixel_values": processed["pixel_values"]}, []  # Gemma 3: its tokens from its text
        counts = (grid.prod(-1) // self.processor.merge_size**2).tolist()
        return {"pixel_values": processed["pixel_values"], "image_grid_thw": grid}, [
            [self.placeholder] * n for n in counts]  # fmt: skip


def _expanded_template(record: dict, tokenizer, assistant_only: bool, images: Images) -> tuple[list[int], list[int]]:
    """Gemma3Processor's way: the chat rendered as text, each image placeholder replaced by its expansion in the text
    (`Images.text`), and the whole text tokenized, so that newlines beside an image merge as the processor's do; the
    trained tokens are those overlapping the characters of the tokens the template marked (`_template`), never an
    image's own tokens."""
    placeholder, expansion = images.text
    _, trained, offsets = _template(record, tokenizer, assistant_only)
    rendered = tokenizer.apply_chat_template(record["messages"], tokenize=False)

    def moved(position: int) -> int:  # a character of the rendered text in the expanded one
        return position + rendered.count(placeholder, 0, position) * (len(expansion) - len(placeholder))

    spans = [(moved(a), moved(b)) for (a, b), on in zip(offsets, trained, strict=True) if on]
    expanded = tokenizer(expansion.join(rendered.split(placeholder)), add_special_tokens=False,
                         return_offsets_mapping=True)  # fmt: skip
    out, k = [], 0
    for token, (start, end) in zip(expanded["input_ids"], expanded["offset_mapping"], strict=True):
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        out.append(int(k < len(spans) and end > spans[k][0] and token not in images.image_ids))
    return expanded["input_ids"], out


def _with_images(record: dict, tokenizer, images: Images, base: Path, assistant_only: bool, tokens=None):
    """A record's token ids and trained flags with its images' tokens in: each image's `tokens` (the processor's), or
    (None) from the images' sizes; Gemma 3's from its text (`_expanded_template`)."""
    if images.text is not None:
        return _expanded_template(record, tokenizer, assistant_only, images)
    ids, trained, _ = _template(record, tokenizer, assistant_only)
    if tokens is None:
        tokens = [images.tokens(*open_image(x, base).size) for x in record.get("images") or []]
    return expand_images(ids, trained, tokens, images.placeholder)


def length(record: dict, tokenizer, images: Images, base: Path, assistant_only=True) -> int:
    """The tokens `encode` makes of a checked record, from its images' sizes (the file headers), not their pixels."""
    return len(_with_images(record, tokenizer, images, base, assistant_only)[0])


def encode(record: dict, tokenizer, images: Images, base: Path, assistant_only=True) -> Sample:
    """One checked record as its model sees it: the chat rendered by the tokenizer's template, each image part
    replaced by the tokens its family's processor makes of it (`Images`), labels on the assistant's tokens only (the
    template's `{% generation %}` markers), or with `assistant_only` false on every token but the images' tokens."""
    pictures = [open_image(x, base).convert("RGB") for x in record.get("images") or []]
    fields, tokens = images.process(pictures) if pictures else ({}, [])
    out_ids, out_trained = _with_images(record, tokenizer, images, base, assistant_only, tokens)
    ids_t = torch.tensor(out_ids)
    labels = torch.where(torch.tensor(out_trained, dtype=torch.bool), ids_t, IGNORE)
    return Sample(ids_t, labels, **fields)


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
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted: the fullest row a sample fits is a bisection away
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k < len(free):
            space, row = free.pop(k)
            packed[row].append(i)
        else:
            space, row = max_length, len(packed)
            packed.append([i])
        bisect.insort(free, (space - lengths[i], row))
    return packed


@dataclass(frozen=True)
class Sample:
    """One chat as the model's processor made it: token ids and labels (1-D), and its images' pixels (Qwen-VL: patches
    with their (temporal, height, width) grids; SmolVLM, Idefics3: tiles with their pixel mask), or none."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_attention_mask: torch.Tensor | None = None
    image_position_ids: torch.Tensor | None = None  # Gemma 4: each patch's (x, y), (-1, -1) on padding


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
        batch = _row(samples)
        rotary = torch.cat([self.positions(s) for s in samples], dim=-1)
        batch["mrope_position_ids"] = rotary[:, None]  # [3, 1, tokens]: the rotary positions (`join_positions`)
        if "pixel_values" in batch:
            batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in samples if s.image_grid_thw is not None])
        return batch


def _row(samples: list[Sample]) -> dict:
    """What every packer's row holds: the samples' ids and labels end to end, each sample's first label masked (the
    token before it is the previous sample's last), `position_ids` [1, tokens] each sample's own 0..n-1 (the
    boundaries), and the images' pixels in order."""
    labels = [torch.cat([s.labels.new_full((1,), IGNORE), s.labels[1:]]) for s in samples]
    batch = {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat([torch.arange(len(s.input_ids)) for s in samples])[None],
    }
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    if pixels:
        batch["pixel_values"] = torch.cat(pixels)
    return batch


class BlockMaskPacker:
    """Packs Gemma 3 or Gemma 4 samples into one row: the `_row` (positions restart at each sample: 1-D RoPE; each
    image is encoded on its own by the vision tower; Gemma 4's with its patches' positions) with the token types (1 on
    image tokens: Gemma 3's `token_type_ids`, Gemma 4's `mm_token_type_ids`). Its attention masks are built on the
    model's device by `sft.model.vision_hooks.block_masks`, from the row's positions and token types."""

    def __init__(self, model: torch.nn.Module):
        self.image_token_id = model.config.image_token_id
        self.key = VISION[model.config.model_type].type_ids

    def __call__(self, samples: list[Sample]) -> dict:
        batch = _row(samples)
        batch[self.key] = (batch["input_ids"] == self.image_token_id).long()
        positions = [s.image_position_ids for s in samples if s.image_position_ids is not None]
        if positions:
            batch["image_position_ids"] = torch.cat(positions)
        return batch


class TiledPacker:
    """Packs SmolVLM or Idefics3 samples into one row: the `_row` (1-D positions restarting at each sample, from which
    transformers' text model keeps the samples apart, as for text), every image's tiles as one batch of images
    ([1, tiles, 3, side, side]) with their pixel mask; each tile is encoded on its own."""

    def __call__(self, samples: list[Sample]) -> dict:
        batch = _row(samples)
        if "pixel_values" in batch:
            batch["pixel_values"] = batch["pixel_values"][None]
            masks = [s.pixel_attention_mask for s in samples if s.pixel_attention_mask is not None]
            batch["pixel_attention_mask"] = torch.cat(masks)[None]
        return batch


# The packer of each way rows keep samples apart (`sft.model.architectures.Vision.packing`)
PACKERS = {"mrope": MRopePacker, "masks": BlockMaskPacker, "positions": lambda model: TiledPacker()}


def packer(model: torch.nn.Module):
    """The packer of an image+text model's family: by its masks (Gemma 3), its M-RoPE positions (Qwen-VL) or its 1-D
    positions (SmolVLM, Idefics3)."""
    return PACKERS[VISION[model.config.model_type].packing](model)


def packing(config) -> str:
    """How an image+text family's rows keep samples apart (`Plan.packing`)."""
    return VISION[config.model_type].packing


class Collator:
    """A micro batch of rows as one padding-free row of the model's inputs. The data sets TRL's trainer iterates hold
    only each row's sample indices and its split (`{"row": [...], "split": "train"}`); the records are encoded here,
    in the data loader, so images are decoded and processed as they are needed, not all at the start."""

    def __init__(self, packer, splits: dict):
        self.packer, self.splits = packer, splits  # split -> (records, encode_one)

    def __call__(self, features: list[dict]) -> dict:
        samples = []
        for feature in features:
            records, encode_one = self.splits[feature["split"]]
            samples += [encode_one(records[j]) for j in feature["row"]]
        return self.packer(samples)


def load_datasets(script_args, data_args, training_args, tokenizer, model_dir: str, run_plan):
    """The checked image+text records of the recipe's sources, measured (`length`: from their images' sizes) and
    packed into rows of `max_length`: (train rows, eval rows or None, the splits a `Collator` reads)."""
    import datasets
    from transformers import AutoImageProcessor

    from sft.data.load import load_source

    if not data_args.datasets:
        raise ConfigError("image+text training reads `datasets:` (local parquet/JSON files or folders); none is given")
    plan = run_plan.vision
    images = Images(run_plan.model_config, tokenizer, AutoImageProcessor.from_pretrained(model_dir))
    splits = {}

    def rows_of(sources, split: str) -> datasets.Dataset:
        parts = []
        for source in sources:
            records = load_source(source)
            check_records(records, Path(source.path), plan.assistant_only)
            parts.append((records, Path(source.path).parent))
        if len({b for _, b in parts}) > 1:
            raise ConfigError("image+text sources in different folders: give the images as absolute paths or bytes")
        records = datasets.concatenate_datasets([p for p, _ in parts]) if len(parts) > 1 else parts[0][0]
        base = parts[0][1]

        def encode_one(record: dict) -> Sample:
            return encode(record, tokenizer, images, base, assistant_only=plan.assistant_only)

        lengths = [length(r, tokenizer, images, base, assistant_only=plan.assistant_only) for r in records]
        packed = rows(lengths, training_args.max_length)
        logger.info("Image+text %s data: %d records packed into %d rows of up to %d tokens (%.1f%% filled)", split,
                    len(lengths), len(packed), training_args.max_length,
                    100 * sum(lengths) / (len(packed) * training_args.max_length))  # fmt: skip
        splits[split] = (records, encode_one)
        return datasets.Dataset.from_dict({"row": packed, "split": [split] * len(packed)})

    train = rows_of(data_args.datasets, "train")
    eval_rows = rows_of(data_args.eval_datasets, "eval") if data_args.eval_datasets else None
    return train, eval_rows, splits


def save_image_processor(model_dir: str, output_dir: str) -> None:
    """The model's image processor beside the trained model, so that the output directory loads and generates on its
    own (`AutoImageProcessor.from_pretrained(output_dir)`)."""
    from transformers import AutoImageProcessor

    AutoImageProcessor.from_pretrained(model_dir).save_pretrained(output_dir)
