"""A packed Gemma 3 image+text row with sft's masks against its samples one at a time, in bf16 on the GPU (issue #55).

    python -m benchmarks.vlm_gemma3_exactness --out $OUT            # on a CUDA GPU
    python -m benchmarks.vlm_gemma3_exactness --tiny --out /tmp/x   # CPU smoke test

A random Gemma 3 at Gemma-3-4B's widths (text: hidden 2560, 8 heads of 256, 4 KV heads; 6 layers, five within a
sliding window of 1,024 tokens and one full; vision: its SigLIP encoder's widths, 896-pixel images in 14-pixel
patches pooled into 256 tokens, 8 of its 27 layers), bf16. Five samples (one image each in three, two images in one,
one text only; 600-2,400 tokens, so that windows bind) packed into one row the way a run packs them
(`sft.data.vision.BlockMaskPacker`, sft's masks built by `block_masks`) through sdpa in bf16; each sample alone
through sdpa in bf16 (transformers' own masks), and alone through eager in fp32 (the reference). The packed row's
differences are read against bf16's own: the same samples alone in bf16 against fp32. transformers' masks on the
packed row (the hook removed) are measured too: what sft's masks are for.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BOI, IMAGE, EOI = 255999, 262144, 256000


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    from sft.data import vision

    device = "cuda" if torch.cuda.is_available() else "cpu"
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
        hook = vision.block_masks(model)
        packed = model(**packed_in, use_cache=False).logits[0].float()
        hook.remove()

    def diff(a, b) -> float:
        return float((a - b).abs().max())

    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "tokens": int(batch["input_ids"].numel()),
        "samples": [len(s.input_ids) for s in rows], "images": int(batch["pixel_values"].shape[0]),
        "max_abs_logit_diff_packed_sft_masks_sdpa_bf16_vs_alone_sdpa_bf16": diff(packed, bf16),
        "max_abs_logit_diff_alone_sdpa_bf16_vs_alone_eager_fp32": diff(bf16, fp32),
        "max_abs_logit_diff_packed_sft_masks_sdpa_bf16_vs_alone_eager_fp32": diff(packed, fp32),
        "max_abs_logit_diff_packed_transformers_masks_sdpa_bf16_vs_alone_eager_fp32": diff(theirs, fp32),
        "mean_abs_logit_fp32": float(fp32.abs().mean()),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vlm_gemma3_exactness.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
