"""A packed Gemma 3, Gemma 4 or SmolVLM image+text row against its samples one at a time, in bf16 on the GPU (issues
#55, #67).

    python -m benchmarks.vlm_family_exactness --family gemma3 --out $OUT            # on a CUDA GPU (gemma4 the same)
    python -m benchmarks.vlm_family_exactness --family smolvlm --tiny --out /tmp/x  # CPU smoke test

Gemma 3: a random Gemma 3 at Gemma-3-4B's widths (text: hidden 2560, 8 heads of 256, 4 KV heads; 6 layers, five
within a sliding window of 1,024 tokens and one full; vision: its SigLIP encoder's widths, 896-pixel images in 14-pixel
patches pooled into 256 tokens, 8 of its 27 layers), bf16. Five samples (one image each in three, two images in one,
one text only; 600-2,400 tokens, so that windows bind) packed into one row the way a run packs them
(`sft.data.vision.BlockMaskPacker`, sft's masks built by `block_masks`) through sdpa in bf16; each sample alone
through sdpa in bf16 (transformers' own masks), and alone through eager in fp32 (the reference). The packed row's
differences are read against bf16's own: the same samples alone in bf16 against fp32. transformers' masks on the
packed row (the hook removed) are measured too: what sft's masks are for.

Gemma 4 the same way (`build_gemma4`, `gemma4_samples`): transformers' default widths of its configs, images of four
sizes through its own image processor, its token types `mm_token_type_ids`, its images both ways in its sliding layers
only.

SmolVLM: a random SmolVLM at SmolVLM2-2.2B's widths (text: a Llama of hidden 2048, 32 heads, 4 of its 24 layers;
vision: SigLIP's widths at 384 pixels, 8 of its 27 layers, 729 patches a tile shuffled into 81 tokens), five samples
(images of 1 to 9 tiles and a global image, one text only) packed by `sft.data.vision.TiledPacker` (positions
restarting) through `sft_varlen`, the run's GPU backend, against each alone through sdpa in bf16 and eager in fp32.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sft.model.architectures import VISION

BOI, IMAGE, EOI = 255999, 262144, 256000
SMOL_IMAGE, FAKE, GLOBAL, ROW = 49190, 49189, 49152, 49153  # SmolVLM2's <image>, <fake_token_around_image>, ...


def build_smolvlm(tiny: bool):
    import transformers as tf

    text = dict(model_type="llama", hidden_size=64 if tiny else 2048, intermediate_size=128 if tiny else 8192,
                num_hidden_layers=2 if tiny else 4, num_attention_heads=4 if tiny else 32,
                num_key_value_heads=2 if tiny else 32, vocab_size=49280, max_position_embeddings=16384,
                rope_parameters={"rope_type": "default", "rope_theta": 273768.0})  # fmt: skip
    encoder = dict(hidden_size=32 if tiny else 1152, intermediate_size=64 if tiny else 4304,
                   num_hidden_layers=2 if tiny else 8, num_attention_heads=2 if tiny else 16,
                   image_size=32 if tiny else 384, patch_size=8 if tiny else 14)  # fmt: skip
    config = tf.SmolVLMConfig(text_config=text, vision_config=encoder, scale_factor=2 if tiny else 3,
                              image_token_id=SMOL_IMAGE)  # fmt: skip
    torch.manual_seed(0)
    return tf.SmolVLMForConditionalGeneration(config).eval()


def smolvlm_samples(model, tiny: bool):
    from sft.data import vision

    gen = torch.Generator().manual_seed(1)
    config = model.config
    side = config.vision_config.image_size
    per_tile = (side // config.vision_config.patch_size) ** 2 // config.scale_factor**2
    scale = 16 if tiny else 1
    layout = [(300, (2, 2), 900), (700, None, 1000), (200, (3, 3), 400), (100, (1, 2), 500), (40, (0, 0), 1200)]
    out = []
    for before, tiles, after in layout:
        text = lambda n: torch.randint(10, 49000, (max(n // scale, 2),), generator=gen)  # noqa: E731
        if tiles is None:
            ids = torch.cat([text(before), text(after)])
            out.append(vision.Sample(ids, ids.clone()))
            continue
        rows, cols = tiles
        image = [FAKE, ROW] + [SMOL_IMAGE] * per_tile
        ids = torch.cat([text(before), torch.tensor(image * (rows * cols) + [FAKE, GLOBAL] + [SMOL_IMAGE] * per_tile
                                                    + [FAKE]), text(after)])  # fmt: skip
        n = rows * cols + 1
        pixels = torch.randn(n, 3, side, side, generator=gen)
        out.append(
            vision.Sample(ids, ids.clone(), pixels, pixel_attention_mask=torch.ones(n, side, side, dtype=torch.bool))
        )
    return out


def smolvlm(args, device) -> dict:
    from sft.data import vision
    from sft.model import attention

    model = build_smolvlm(args.tiny).to(device)
    rows = smolvlm_samples(model, args.tiny)
    batch = {k: v.to(device) for k, v in vision.TiledPacker()(rows).items()}

    def alone(impl: str, dtype) -> torch.Tensor:
        model.to(dtype).set_attn_implementation(impl)
        logits = []
        for s in rows:
            inputs = {"input_ids": s.input_ids[None].to(device), "use_cache": False}
            if s.pixel_values is not None:
                inputs |= {"pixel_values": s.pixel_values[None].to(device, dtype),
                           "pixel_attention_mask": s.pixel_attention_mask[None].to(device)}  # fmt: skip
            logits.append(model(**inputs).logits[0].float())
        return torch.cat(logits)

    with torch.no_grad():
        fp32 = alone("eager", torch.float32)
        bf16 = alone("sdpa", torch.bfloat16)
        attention.register_varlen()
        model.set_attn_implementation(attention.VARLEN)
        packed_in = batch | {"pixel_values": batch["pixel_values"].to(torch.bfloat16), "use_cache": False}
        packed = model(**packed_in).logits[0].float()
    return {
        "tokens": int(batch["input_ids"].numel()), "samples": [len(s.input_ids) for s in rows],
        "tiles": int(batch["pixel_values"].shape[1]),
        "max_abs_logit_diff_packed_varlen_bf16_vs_alone_sdpa_bf16": diff(packed, bf16),
        "max_abs_logit_diff_alone_sdpa_bf16_vs_alone_eager_fp32": diff(bf16, fp32),
        "max_abs_logit_diff_packed_varlen_bf16_vs_alone_eager_fp32": diff(packed, fp32),
        "mean_abs_logit_fp32": float(fp32.abs().mean()),
    }  # fmt: skip


def diff(a, b) -> float:
    return float((a - b).abs().max())


def build(tiny: bool):
    import transformers as tf

    text = dict(hidden_size=64 if tiny else 2560, intermediate_size=128 if tiny else 10240,
                num_hidden_layers=6, num_attention_heads=4 if tiny else 8, num_key_value_heads=2 if tiny else 4,
                head_dim=16 if tiny else 256, sliding_window=64 if tiny else 1024, vocab_size=262208,
                layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=32768)  # fmt: skip
    encoder = dict(hidden_size=32 if tiny else 1152, intermediate_size=64 if tiny else 4304,
                   num_hidden_layers=2 if tiny else 8, num_attention_heads=2 if tiny else 16,
                   image_size=56 if tiny else 896, patch_size=14, vision_use_head=False)  # fmt: skip
    config = tf.Gemma3Config(text_config=text, vision_config=encoder, mm_tokens_per_image=4 if tiny else 256,
                             image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)  # fmt: skip
    torch.manual_seed(0)
    return tf.Gemma3ForConditionalGeneration(config).eval()


def samples(model, tiny: bool):
    from sft.data import vision

    gen = torch.Generator().manual_seed(1)
    side, tokens = model.config.vision_config.image_size, model.config.mm_tokens_per_image
    scale = 16 if tiny else 1
    layout = [(300, 1, 900), (700, 0, 1000), (200, 2, 1500), (100, 1, 500), (40, 1, 2200)]  # text, images, text
    out = []
    for before, images, after in layout:
        text = lambda n: torch.randint(10, 250000, (max(n // scale, 2),), generator=gen)  # noqa: E731
        parts = [text(before)]
        for _ in range(images):
            parts += [torch.tensor([BOI] + [IMAGE] * tokens + [EOI]), text(60)]
        ids = torch.cat([*parts, text(after)])
        pixels = torch.randn(images, 3, side, side, generator=gen) if images else None
        out.append(vision.Sample(ids, ids.clone(), pixels))
    return out


def masked_rows(model, rows, device) -> tuple[dict, dict]:
    """A family packed by sft's masks (Gemma 3, Gemma 4): each sample alone through eager fp32 (the reference) and sdpa
    bf16 (transformers' own masks, its token types from the image token), the packed row through sdpa bf16 with
    transformers' masks and with sft's (`block_masks`). The figures every such family reports, and the logits."""
    from sft.data import vision
    from sft.model import vision_hooks

    key, image = VISION[model.config.model_type].type_ids, model.config.image_token_id
    batch = {k: v.to(device) for k, v in vision.BlockMaskPacker(model)(rows).items()}

    def alone(impl: str, dtype) -> torch.Tensor:
        model.to(dtype).set_attn_implementation(impl)
        logits = []
        for s in rows:
            ids = s.input_ids[None].to(device)
            inputs = {"input_ids": ids, key: (ids == image).long(), "use_cache": False}
            if s.pixel_values is not None:
                inputs["pixel_values"] = s.pixel_values.to(device, dtype)
            if s.image_position_ids is not None:
                inputs["image_position_ids"] = s.image_position_ids.to(device)
            logits.append(model(**inputs).logits[0].float())
        return torch.cat(logits)

    with torch.no_grad():
        fp32 = alone("eager", torch.float32)
        bf16 = alone("sdpa", torch.bfloat16)
        packed_in = batch | {"pixel_values": batch["pixel_values"].to(torch.bfloat16)}
        theirs = model(**packed_in, use_cache=False).logits[0].float()  # transformers' masks on the packed row
        hook = vision_hooks.block_masks(model)
        packed = model(**packed_in, use_cache=False).logits[0].float()
        hook.remove()
    figures = {
        "tokens": int(batch["input_ids"].numel()), "samples": [len(s.input_ids) for s in rows],
        "images": int(batch["pixel_values"].shape[0]),
        "max_abs_logit_diff_packed_sft_masks_sdpa_bf16_vs_alone_sdpa_bf16": diff(packed, bf16),
        "max_abs_logit_diff_alone_sdpa_bf16_vs_alone_eager_fp32": diff(bf16, fp32),
        "max_abs_logit_diff_packed_sft_masks_sdpa_bf16_vs_alone_eager_fp32": diff(packed, fp32),
        "max_abs_logit_diff_packed_transformers_masks_sdpa_bf16_vs_alone_eager_fp32": diff(theirs, fp32),
        "mean_abs_logit_fp32": float(fp32.abs().mean()),
    }  # fmt: skip
    return figures, {"packed": packed, "bf16": bf16, "fp32": fp32, "theirs": theirs}


def gemma3(args, device) -> dict:
    model = build(args.tiny).to(device)
    return masked_rows(model, samples(model, args.tiny), device)[0]


def build_gemma4(tiny: bool):
    """A random Gemma 4 at transformers' default widths of its configs (text: hidden 2304, 8 heads of 256, full layers
    of 512, 4 KV heads, a sliding window of 512, per-layer inputs of 256; vision: hidden 768, 12 heads of 64, 16-pixel
    patches pooled 3 x 3, at most 280 tokens an image), 6 text layers (five sliding, one full) and 8 of the encoder's
    16, its images both ways in the sliding layers."""
    import transformers as tf

    text = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                use_bidirectional_attention="vision", max_position_embeddings=32768)  # fmt: skip
    vision = dict(num_hidden_layers=8)
    if tiny:
        text |= dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     global_head_dim=32, sliding_window=64, hidden_size_per_layer_input=8)  # fmt: skip
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, patch_size=8, pooling_kernel_size=2)  # fmt: skip
    config = tf.Gemma4Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    return tf.Gemma4ForConditionalGeneration(config).eval()


def gemma4_samples(model, tiny: bool):
    """Five samples: images of four sizes (aspect ratios 1, 2, 1/3 and 3/4: their token counts differ) in four, two
    in one, one of text only; each image's tokens framed by its begin and end tokens, its patches from Gemma 4's own
    image processor (random pixels)."""
    import numpy as np
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from sft.data import vision

    config = model.config
    processor = Gemma4ImageProcessorPil(**({"patch_size": 8, "max_soft_tokens": 70, "pooling_kernel_size": 2}
                                           if tiny else {}))  # fmt: skip
    rng = np.random.default_rng(1)
    gen = torch.Generator().manual_seed(1)
    scale = 16 if tiny else 1
    sizes = {1: [(768, 768)], 2: [(1024, 512), (300, 900)], 3: [(600, 800)], 4: [(512, 512)]}
    layout = [(300, 1, 900), (700, 0, 1000), (200, 2, 1500), (100, 3, 500), (40, 4, 1200)]  # text, images, text
    out = []
    for before, which, after in layout:
        text = lambda n: torch.randint(10, 250000, (max(n // scale, 2),), generator=gen)  # noqa: E731
        pictures = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes.get(which, [])]
        parts, fields = [text(before)], {}
        if pictures:
            processed = processor(images=pictures, return_tensors="pt")
            fields = {"pixel_values": processed["pixel_values"], "image_position_ids": processed["image_position_ids"]}
            for n in processed["num_soft_tokens_per_image"].tolist():
                parts += [torch.tensor([config.boi_token_id] + [config.image_token_id] * n + [config.eoi_token_id]),
                          text(60)]  # fmt: skip
        ids = torch.cat([*parts, text(after)])
        out.append(vision.Sample(ids, ids.clone(), **fields))
    return out


def gemma4(args, device) -> dict:
    model = build_gemma4(args.tiny).to(device)
    rows = gemma4_samples(model, args.tiny)
    figures, logits = masked_rows(model, rows, device)
    packed, bf16, fp32, theirs = (logits[k] for k in ("packed", "bf16", "fp32", "theirs"))
    image = model.config.image_token_id
    return {
        **figures,
        "image_tokens": [int((s.input_ids == image).sum()) for s in rows],
        # bf16's noise is heavy-tailed at these random widths: the mean difference too, over every token and over the
        # later samples' tokens only (those a leak reaches: the first sample has nothing before it)
        **{f"mean_abs_logit_diff_{name}{where}": float((a - b)[part].abs().mean())
           for name, a, b in (("packed_sft_masks_sdpa_bf16_vs_alone_sdpa_bf16", packed, bf16),
                              ("alone_sdpa_bf16_vs_alone_eager_fp32", bf16, fp32),
                              ("packed_sft_masks_sdpa_bf16_vs_alone_eager_fp32", packed, fp32),
                              ("packed_transformers_masks_sdpa_bf16_vs_alone_eager_fp32", theirs, fp32))
           for where, part in (("", slice(None)), ("_later_samples", slice(len(rows[0].input_ids), None)))},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["gemma3", "gemma4", "smolvlm"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "family": args.family,
        **{"gemma3": gemma3, "gemma4": gemma4, "smolvlm": smolvlm}[args.family](args, device),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"vlm_{args.family}_exactness.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
