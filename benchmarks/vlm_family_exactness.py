"""A packed Gemma 3 or SmolVLM image+text row against its samples one at a time, in bf16 on the GPU (issue #55).

    python -m benchmarks.vlm_family_exactness --family gemma3 --out $OUT            # on a CUDA GPU
    python -m benchmarks.vlm_family_exactness --family smolvlm --tiny --out /tmp/x  # CPU smoke test

Gemma 3: a random Gemma 3 at Gemma-3-4B's widths (text: hidden 2560, 8 heads of 256, 4 KV heads; 6 layers, five
within a sliding window of 1,024 tokens and one full; vision: its SigLIP encoder's widths, 896-pixel images in 14-pixel
patches pooled into 256 tokens, 8 of its 27 layers), bf16. Five samples (one image each in three, two images in one,
one text only; 600-2,400 tokens, so that windows bind) packed into one row the way a run packs them
(`sft.data.vision.BlockMaskPacker`, sft's masks built by `block_masks`) through sdpa in bf16; each sample alone
through sdpa in bf16 (transformers' own masks), and alone through eager in fp32 (the reference). The packed row's
differences are read against bf16's own: the same samples alone in bf16 against fp32. transformers' masks on the
packed row (the hook removed) are measured too: what sft's masks are for.

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


def gemma3(args, device) -> dict:
    from sft.data import vision
    from sft.model import vision_hooks

    model = build(args.tiny).to(device)
    rows = samples(model, args.tiny)
    batch = {k: v.to(device) for k, v in vision.BlockMaskPacker(model)(rows).items()}

    def alone(impl: str, dtype) -> torch.Tensor:
        model.to(dtype).set_attn_implementation(impl)
        logits = []
        for s in rows:
            ids = s.input_ids[None].to(device)
            inputs = {"input_ids": ids, "token_type_ids": (ids == IMAGE).long(), "use_cache": False}
            if s.pixel_values is not None:
                inputs["pixel_values"] = s.pixel_values.to(device, dtype)
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
    return {
        "tokens": int(batch["input_ids"].numel()), "samples": [len(s.input_ids) for s in rows],
        "images": int(batch["pixel_values"].shape[0]),
        "max_abs_logit_diff_packed_sft_masks_sdpa_bf16_vs_alone_sdpa_bf16": diff(packed, bf16),
        "max_abs_logit_diff_alone_sdpa_bf16_vs_alone_eager_fp32": diff(bf16, fp32),
        "max_abs_logit_diff_packed_sft_masks_sdpa_bf16_vs_alone_eager_fp32": diff(packed, fp32),
        "max_abs_logit_diff_packed_transformers_masks_sdpa_bf16_vs_alone_eager_fp32": diff(theirs, fp32),
        "mean_abs_logit_fp32": float(fp32.abs().mean()),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["gemma3", "smolvlm"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "family": args.family,
        **(gemma3 if args.family == "gemma3" else smolvlm)(args, device),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"vlm_{args.family}_exactness.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
