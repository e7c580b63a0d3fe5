"""A packed image+text row on the GPU path against its samples one at a time, in bf16 (issue #55).

    python -m benchmarks.vlm_exactness --out $OUT            # on a CUDA GPU
    python -m benchmarks.vlm_exactness --tiny --out /tmp/x   # CPU smoke test

A random Qwen2.5-VL (text: hidden 1536, 4 layers, 12 heads, 2 KV heads; vision: Qwen2.5-VL-7B's encoder widths with 8
blocks, windows of 112 pixels, full attention in blocks 3 and 7), bf16. Five samples (four with one image of uneven
patch grids, one text only) packed into one row the way a run packs them (`sft.data.vision.MRopePacker`, the
boundary row joined by `join_positions`) run through `sft_varlen` (PyTorch's varlen FlashAttention-2; the encoder on
its one-call name, `attention.vision_encoder_on_varlen`); each sample alone through sdpa in bf16 (the model's own
positions), and alone through eager in fp32 (the reference). The packed row's differences are read against bf16's
own: the same samples alone in bf16 against fp32. The encoder's output is compared the same way.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653


def build(tiny: bool):
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3] if tiny else [16, 24, 24]}
    text = dict(hidden_size=64 if tiny else 1536, intermediate_size=128 if tiny else 8960,
                num_hidden_layers=2 if tiny else 4, num_attention_heads=4 if tiny else 12, num_key_value_heads=2,
                vocab_size=152064, max_position_embeddings=32768, rope_parameters=rope)  # fmt: skip
    vision = dict(depth=2 if tiny else 8, hidden_size=32 if tiny else 1280, intermediate_size=64 if tiny else 3420,
                  num_heads=2 if tiny else 16, out_hidden_size=text["hidden_size"], patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[1] if tiny else [3, 7])  # fmt: skip
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                                 vision_start_token_id=START, vision_end_token_id=END)  # fmt: skip
    torch.manual_seed(0)
    return tf.Qwen2_5_VLForConditionalGeneration(config).eval()


def samples(tiny: bool):
    from sft.data import vision

    gen = torch.Generator().manual_seed(1)
    dim = 3 * 2 * 14 * 14
    grids = [(1, 8, 12), None, (1, 16, 8), (1, 4, 4), (1, 12, 20)] if tiny else [
        (1, 32, 40), None, (1, 64, 48), (1, 8, 8), (1, 44, 28)]  # fmt: skip
    out = []
    for k, grid in enumerate(grids):
        before, after = 20 + 7 * k, 300 + 90 * k
        text = lambda n: torch.randint(10, 150000, (n,), generator=gen)  # noqa: E731
        if grid is None:
            ids = text(before + after)
            out.append(vision.Sample(ids, ids.clone()))
            continue
        t, h, w = grid
        ids = torch.cat([text(before), torch.tensor([START] + [IMAGE] * (t * h * w // 4) + [END]), text(after)])
        out.append(vision.Sample(ids, ids.clone(), torch.randn(t * h * w, dim, generator=gen), torch.tensor([grid])))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    from sft.data import vision
    from sft.model import attention, vision_hooks

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(args.tiny).to(device)
    rows = samples(args.tiny)
    batch = {k: v.to(device) for k, v in vision.MRopePacker(model)(rows).items()}
    hook = vision_hooks.join_positions(model)

    def alone(impl: str, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        model.to(dtype).set_attn_implementation(impl)
        logits, encoded = [], []
        for s in rows:
            inputs = {"input_ids": s.input_ids[None].to(device), "use_cache": False}
            if s.pixel_values is not None:
                pixels, grid = s.pixel_values.to(device, dtype), s.image_grid_thw.to(device)
                inputs |= {"pixel_values": pixels, "image_grid_thw": grid,
                           "mm_token_type_ids": (s.input_ids == IMAGE).int()[None].to(device)}  # fmt: skip
                encoded.append(model.model.visual(pixels, grid_thw=grid).pooler_output)
            logits.append(model(**inputs).logits[0].float())
        return torch.cat(logits), torch.cat([e.float() for e in encoded])

    with torch.no_grad():
        hook.remove()  # alone: the model's own positions
        fp32, fp32_encoded = alone("eager", torch.float32)
        bf16, bf16_encoded = alone("sdpa", torch.bfloat16)
        hook = vision_hooks.join_positions(model)
        attention.register_varlen()
        model.set_attn_implementation(attention.VARLEN)
        assert attention.vision_encoder_on_varlen(model)
        packed_in = batch | {"pixel_values": batch["pixel_values"].to(torch.bfloat16)}
        packed = model(**packed_in, use_cache=False).logits[0].float()
        packed_encoded = model.model.visual(
            packed_in["pixel_values"], grid_thw=batch["image_grid_thw"]
        ).pooler_output.float()

    def diff(a, b) -> float:
        return float((a - b).abs().max())

    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "tokens": int(batch["input_ids"].numel()),
        "samples": len(rows), "images": int(batch["image_grid_thw"].shape[0]),
        "max_abs_logit_diff_packed_varlen_bf16_vs_alone_sdpa_bf16": diff(packed, bf16),
        "max_abs_logit_diff_alone_sdpa_bf16_vs_alone_eager_fp32": diff(bf16, fp32),
        "max_abs_logit_diff_packed_varlen_bf16_vs_alone_eager_fp32": diff(packed, fp32),
        "max_abs_encoder_diff_varlen_bf16_vs_sdpa_bf16": diff(packed_encoded, bf16_encoded),
        "max_abs_encoder_diff_sdpa_bf16_vs_eager_fp32": diff(bf16_encoded, fp32_encoded),
        "max_abs_encoder_diff_varlen_bf16_vs_eager_fp32": diff(packed_encoded, fp32_encoded),
        "mean_abs_logit_fp32": float(fp32.abs().mean()),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vlm_exactness.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
