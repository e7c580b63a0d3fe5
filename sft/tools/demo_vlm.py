"""Build the vision-language demo: the text demo's tokenizer with vision tokens, a tiny Qwen2.5-VL config, an image
processor config and a synthetic data set of coloured shapes with questions about them (issue #55).

Nothing here is downloaded. ``python -m sft.tools.demo_vlm --out recipes/demo-vlm`` writes:

- ``model/``: ``config.json`` of a 4-layer Qwen2.5-VL (text hidden 128; a 2-block vision tower), the character-level
  tokenizer of ``sft.tools.demo`` plus ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` (and
  ``<|video_pad|>``, which the config must name; no video in the data), a chat template
  that renders an image part as those three tokens and marks the assistant's tokens (``{% generation %}``), and
  ``preprocessor_config.json``: Qwen2-VL's image processor at 56 x 56 pixels (4 x 4 patches of 14, merged 2 x 2 into 4
  image tokens);
- ``data/train.parquet`` and ``data/eval.parquet``: TRL's vision records (``messages`` whose parts are
  ``{"type": "image"}`` or text, ``images`` a list of PNG images as a datasets ``Image`` column stores them) asking
  the colour, the shape, or both, of one shape drawn at a random place and size on a white image.

The output is a pure function of ``--seed``. ``python -m sft.tools.demo_vlm --evaluate outputs/demo-vlm`` answers the
held-out questions with a trained run (greedy) and prints the share answered exactly, per kind of question.
"""

from __future__ import annotations

import argparse
import io
import json
import random
from pathlib import Path

from sft.tools import demo

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]  # no video in the data
GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]  # Gemma 3's: what its template writes,
# the image's tokens, the end (Gemma3Processor's `full_image_sequence`)
GEMMA4_TOKENS = ["<|image|>", "<|image>", "<image|>", "<|audio|>", "<|audio>", "<audio|>"]  # Gemma 4's: what its
# template writes (the image's tokens), the begin and end of an image; its audio's, which its processor asks for
TILES = [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]  # SmolVLM's tile tokens: up to 4 x 4
SMOLVLM_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", *TILES]


def chat_template(image: str = "<|vision_start|><|image_pad|><|vision_end|>") -> str:
    """The demo's chat template, an image part rendered as `image`, the assistant's tokens marked."""
    parts = (
        "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
        "{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}" + image + "{%- else -%}"
        "{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    )
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'assistant' -%}<|assistant|>{% generation %}" + parts + "<|end|>{% endgeneration %}"
        "{%- else -%}<|{{ message['role'] }}|>" + parts + "<|end|>{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    )


CHAT_TEMPLATE = chat_template()
PIXELS = 56  # one image: 4 x 4 patches of 14 pixels, merged 2 x 2 into 4 tokens
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?", "both": "Describe the shape."}


def build_tokenizer(family: str = "qwen2_5_vl"):
    names = ("image_token", "boi_token", "eoi_token", "audio_token", "boa_token", "eoa_token")
    named = dict(zip(names, GEMMA4_TOKENS, strict=True)) if family == "gemma4" else None  # Gemma4Processor reads them
    tokenizer = demo.build_tokenizer(named)
    tokens = {"gemma3": GEMMA3_TOKENS, "gemma4": GEMMA4_TOKENS, "smolvlm": SMOLVLM_TOKENS}.get(family)
    if tokens:
        tokenizer.add_tokens(tokens, special_tokens=True)
        tokenizer.chat_template = chat_template(tokens[0])
        return tokenizer
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_image_processor(patch_size: int = 14):
    """Qwen2-VL's image processor making 4 image tokens of a demo image: 2 x 2 merged groups of 2 x 2 patches (a
    56-pixel image at Qwen2/2.5-VL's 14-pixel patches; resized to 64 pixels at Qwen3-VL's 16)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = 4 * patch_size
    return Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=side * side, patch_size=patch_size,
                                    merge_size=2, temporal_patch_size=2)  # fmt: skip


FAMILIES = (
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_vl",
    "gemma3",
    "gemma4",
    "smolvlm",
    "qwen3_5",
)  # the demo's model first; the others for tests


def gemma3_config(tokenizer) -> dict:
    """A tiny Gemma 3: 4 text layers of hidden 128 (three within a sliding window of 32 tokens, one full), a 2-layer
    SigLIP encoder of hidden 64 over 56-pixel images (4 x 4 patches of 14), pooled into 4 image tokens."""
    boi, soft, eoi = tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS)
    text = {
        "model_type": "gemma3_text", "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "sliding_window": 32, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "max_position_embeddings": 1024, "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
    }  # fmt: skip
    vision = {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": PIXELS, "patch_size": 14,
              "vision_use_head": False}  # fmt: skip
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
            "vision_config": vision, "mm_tokens_per_image": 4, "boi_token_index": boi, "image_token_index": soft,
            "eoi_token_index": eoi, "dtype": "float32"}  # fmt: skip


def gemma4_config(tokenizer) -> dict:
    """A tiny Gemma 4: 4 text layers of hidden 128 (sliding within a window of 32 tokens and full of a wider head, in
    turn; the last two reuse the first two's keys and values; per-layer inputs of width 16), its images both ways in
    the sliding layers; a 2-layer encoder of hidden 64 over patches of 8 pixels pooled 2 x 2 (a 56-pixel demo image is
    resized to 128: 64 image tokens)."""
    image, boi, eoi, audio, boa, eoa = tokenizer.convert_tokens_to_ids(GEMMA4_TOKENS)
    text = {
        "model_type": "gemma4_text", "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "global_head_dim": 64, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": len(tokenizer),
        "use_bidirectional_attention": "vision", "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }  # fmt: skip
    vision = {"model_type": "gemma4_vision", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "patch_size": 8,
              "pooling_kernel_size": 2, "position_embedding_size": 64}  # fmt: skip
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
            "vision_config": vision, "audio_config": None, "image_token_id": image, "boi_token_id": boi,
            "eoi_token_id": eoi, "audio_token_id": audio, "boa_token_id": boa, "eoa_token_index": eoa,
            "dtype": "float32"}  # fmt: skip


def model_config(tokenizer, family: str = "qwen2_5_vl") -> dict:
    """The tiny model of `family`: 4 text layers of hidden 128 (M-RoPE sections 4/6/6 of the 16 rotary pairs of a
    32-wide head), a 2-block vision encoder of hidden 64 (Qwen2.5-VL's second block attends over the whole image, its
    first within windows; Qwen3-VL's first feeds a deepstack merger)."""
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(names, VISION_TOKENS, strict=True)}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    if family in ("qwen3_vl", "qwen3_5"):
        rope["mrope_interleaved"] = True
    text = {
        "model_type": f"{family}_text", "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_parameters": rope, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }  # fmt: skip
    if family == "qwen3_5":  # Gated DeltaNet linear attention on layers 1-3, full attention on the last
        rope["partial_rotary_factor"] = 1.0
        text |= {
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        }
    common = {"depth": 2, "num_heads": 2, "spatial_merge_size": 2, "temporal_patch_size": 2}
    vision = {
        "qwen2_5_vl": {**common, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128,
                       "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]},
        "qwen2_vl": {**common, "embed_dim": 64, "hidden_size": 128, "mlp_ratio": 2, "patch_size": 14},
        "qwen3_vl": {**common, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128, "patch_size": 16,
                     "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        "qwen3_5": {**common, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128, "patch_size": 16,
                    "num_position_embeddings": 64},
    }[family]  # fmt: skip
    if family == "qwen2_5_vl":
        text.pop("head_dim")  # hidden / heads: the shipped demo's config as it was
    architecture = {"qwen2_5_vl": "Qwen2_5_VL", "qwen2_vl": "Qwen2VL", "qwen3_vl": "Qwen3VL", "qwen3_5": "Qwen3_5"}[
        family
    ]
    return {"architectures": [f"{architecture}ForConditionalGeneration"], "model_type": family,
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
            "dtype": "float32", **ids}  # fmt: skip


def smolvlm_config(tokenizer) -> dict:
    """A tiny SmolVLM: a 4-layer Llama of hidden 128, a 2-layer encoder of hidden 64 over 32-pixel tiles (4 x 4 patches
    of 8, shuffled into 4 image tokens); a 56-pixel demo image is resized to 64 and cut into 2 x 2 tiles and a
    global image (20 image tokens)."""
    text = {
        "model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "tie_word_embeddings": False,
    }  # fmt: skip
    vision = {"model_type": "smolvlm_vision", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 8}  # fmt: skip
    return {"architectures": ["SmolVLMForConditionalGeneration"], "model_type": "smolvlm", "text_config": text,
            "vision_config": vision, "scale_factor": 2, "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
            "tie_word_embeddings": False, "dtype": "float32"}  # fmt: skip


def _image_processor(family: str):
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": PIXELS, "width": PIXELS}, do_pan_and_scan=False)
    if family == "gemma4":
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        return Gemma4ImageProcessorPil(patch_size=8, max_soft_tokens=70, pooling_kernel_size=2)
    if family == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        return SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    return build_image_processor(16 if family in ("qwen3_vl", "qwen3_5") else 14)


def write_model(model_dir: Path, family: str = "qwen2_5_vl") -> Path:
    """The demo's model directory for `family`: tokenizer, image processor, config (no weights: `from_scratch`)."""
    tokenizer = build_tokenizer(family)
    tokenizer.save_pretrained(model_dir)
    _image_processor(family).save_pretrained(model_dir)
    configs = {"gemma3": gemma3_config, "gemma4": gemma4_config, "smolvlm": smolvlm_config}
    config = configs[family](tokenizer) if family in configs else model_config(tokenizer, family)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return model_dir


def draw(shape: str, colour: str, rng: random.Random) -> bytes:
    """A PNG of one filled shape of `colour` at a random place and size on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (PIXELS, PIXELS), "white")
    size = rng.randint(18, 34)
    x, y = rng.randint(2, PIXELS - size - 2), rng.randint(2, PIXELS - size - 2)
    box, fill = (x, y, x + size, y + size), COLOURS[colour]
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_record(rng: random.Random) -> dict:
    shape, colour, ask = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(QUESTIONS))
    answer = {"colour": colour, "shape": shape, "both": f"a {colour} {shape}"}[ask]
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": QUESTIONS[ask]}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": [{"bytes": draw(shape, colour, rng), "path": None}],
    }


def write_demo(out: Path, n_train: int = 2000, n_eval: int = 200, seed: int = 0) -> None:
    import datasets

    write_model(out / "model")
    rng = random.Random(seed)
    records = [make_record(rng) for _ in range(n_train + n_eval)]
    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
        "images": datasets.Sequence(datasets.Image()),
    })  # fmt: skip
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", records[n_eval:]), ("eval", records[:n_eval])):
        datasets.Dataset.from_list(rows, features=features).to_parquet(str(data_dir / f"{name}.parquet"))


def evaluate(run_dir: Path, data: Path, limit: int | None = None) -> dict[str, float]:
    """The share of held-out questions a trained run answers exactly (greedy decoding), per kind of question."""
    import datasets
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from sft.data import vision

    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    processor = AutoImageProcessor.from_pretrained(run_dir)
    model = AutoModelForImageTextToText.from_pretrained(run_dir).eval()
    records = datasets.load_dataset("parquet", data_files=str(data), split="train")
    end, image = tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.convert_tokens_to_ids("<|image_pad|>")
    kinds = {question: kind for kind, question in QUESTIONS.items()}
    right: dict[str, list[int]] = {kind: [0, 0] for kind in QUESTIONS}
    for record in records.select(range(min(limit or len(records), len(records)))):
        ids = tokenizer.apply_chat_template(record["messages"][:1], tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"]  # fmt: skip
        pixels = processor(images=[vision.open_image(record["images"][0], data.parent).convert("RGB")],
                           return_tensors="pt")  # fmt: skip
        tokens = int(pixels["image_grid_thw"].prod()) // processor.merge_size**2
        prompt = torch.tensor([vision.expand_images(ids, [0] * len(ids), [[image] * tokens], image)[0]])
        with torch.no_grad():
            out = model.generate(input_ids=prompt, pixel_values=pixels["pixel_values"],
                                 image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(prompt == image).int(),
                                 max_new_tokens=24, do_sample=False, eos_token_id=end)  # fmt: skip
        answer = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True).strip()
        kind = kinds[record["messages"][0]["content"][1]["text"]]
        right[kind][0] += answer == record["messages"][1]["content"][0]["text"]
        right[kind][1] += 1
    return {kind: hits / total for kind, (hits, total) in right.items() if total}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("recipes/demo-vlm"), help="Directory to write into.")
    parser.add_argument("--n-train", type=int, default=2000, help="Number of training records.")
    parser.add_argument("--n-eval", type=int, default=200, help="Number of held-out eval records.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the record generator.")
    parser.add_argument("--evaluate", type=Path, metavar="RUN_DIR", help="Answer the held-out questions with a run.")
    args = parser.parse_args(argv)
    if args.evaluate:
        shares = evaluate(args.evaluate, args.out / "data" / "eval.parquet")
        print(", ".join(f"{kind}: {share:.0%} answered exactly" for kind, share in shares.items()))
        return
    write_demo(args.out, args.n_train, args.n_eval, args.seed)
    print(f"wrote the vision-language demo's tokenizer, image processor, model config and data to {args.out}")


if __name__ == "__main__":
    main()
