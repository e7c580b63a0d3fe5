"""Image+text samples packed into one row (`sft.data.vision`) against the same samples one at a time, through
transformers' `eager` attention in fp32, for each M-RoPE family on tiny random models: every token's logits within
1e-5, the packed loss the token-weighted mean of the samples' losses; the same row without the boundary row leaks."""

from __future__ import annotations

import pytest
import torch

from sft.data import vision
from sft.errors import ConfigError
from sft.model import vision_hooks
from sft.model.architectures import VISION
from tests.conftest import ROOT
from tests.tiny_models import END, IMAGE, START, sample, tiny


@pytest.fixture(scope="module", params=sorted(f for f, v in VISION.items() if v.packing == "mrope"))
def packed_and_alone(request):
    model = tiny(request.param)
    patch = model.config.vision_config.patch_size
    gen = torch.Generator().manual_seed(1)
    dim = 3 * 2 * patch**2  # channels x temporal patch x patch x patch
    samples = [sample(gen, 5, (1, 4, 6), 7, dim), sample(gen, 3, None, 9, 0), sample(gen, 3, (1, 8, 4), 11, dim),
               sample(gen, 9, (1, 2, 2), 4, dim)]  # fmt: skip
    packer = vision.MRopePacker(model)
    batch = packer(samples)
    vision_hooks.join_positions(model)  # as a run's plan puts it on the model
    with torch.no_grad():
        packed = model(**batch, use_cache=False)
        alone = []
        for s in samples:
            inputs = {"input_ids": s.input_ids[None], "labels": s.labels[None], "use_cache": False}
            if s.pixel_values is not None:  # the model's own positions: M-RoPE from the image token types
                inputs |= {"pixel_values": s.pixel_values, "image_grid_thw": s.image_grid_thw,
                           "mm_token_type_ids": (s.input_ids == IMAGE).int()[None]}  # fmt: skip
            alone.append(model(**inputs))
        alone_rows = {k: v for k, v in batch.items() if k != "mrope_position_ids"}  # the M-RoPE rows, no boundaries
        leaked = model(**alone_rows | {"position_ids": batch["mrope_position_ids"]}, use_cache=False)
    return request.param, samples, batch, packed, alone, leaked


def test_a_packed_row_equals_its_samples_one_at_a_time(packed_and_alone):
    family, samples, batch, packed, alone, _ = packed_and_alone
    logits = packed.logits[0]
    start = 0
    for s, out in zip(samples, alone, strict=True):
        n = len(s.input_ids)
        assert torch.allclose(logits[start : start + n], out.logits[0], rtol=0, atol=1e-5), (family, start)
        start += n
    counts = [int((s.labels[1:] != vision.IGNORE).sum()) for s in samples]  # the tokens each sample's loss averages
    weighted = sum(c * out.loss for c, out in zip(counts, alone, strict=True)) / sum(counts)
    assert torch.allclose(packed.loss, weighted, rtol=1e-6), (family, packed.loss, weighted)
    starts = torch.cumsum(torch.tensor([0] + [len(s.input_ids) for s in samples[:-1]]), 0)
    assert (batch["labels"][0, starts] == vision.IGNORE).all()  # no sample is predicted from the one before
    tokens = sum(len(s.input_ids) for s in samples)
    assert batch["position_ids"].shape == (1, tokens) and batch["mrope_position_ids"].shape == (3, 1, tokens)


def test_without_the_boundary_row_the_samples_attend_to_each_other(packed_and_alone):
    family, samples, _, packed, _, leaked = packed_and_alone
    first = len(samples[0].input_ids)
    assert torch.equal(leaked.logits[0, :first], packed.logits[0, :first])  # the first sample sees nothing before it
    assert (leaked.logits[0, first:] - packed.logits[0, first:]).abs().max() > 1e-2, family


@pytest.mark.parametrize("family", ["llava", "llama"])
def test_families_not_packed_exactly_are_refused_with_the_reason(family):
    from types import SimpleNamespace

    with pytest.raises(ConfigError) as error:
        vision.check(SimpleNamespace(model_type=family))
    message = str(error.value)
    assert f"`{family}`" in message and "not a vision-language family sft packs" in message
    assert all(name in message for name in ("qwen2_5_vl", "gemma3", "smolvlm", "idefics3"))
    assert "TRL's SFTTrainer" in message
    assert "packing: false" not in message  # sft refuses that for these models: no advice that leads to a refusal
    for taken in ("gemma3", "smolvlm", "idefics3", "qwen3_vl"):
        vision.check(SimpleNamespace(model_type=taken))


def test_image_records_are_checked_up_front_and_the_bad_one_named(tmp_path):
    """TRL's vision records (image parts in `messages`, `images` beside them): paths relative to the data file, bytes
    as a datasets Image column keeps them, PIL images; a missing file, a truncated PNG, a count that does not match
    and a malformed part are each a DataError naming the file, the record and the field."""
    from PIL import Image

    from sft.errors import DataError

    picture = tmp_path / "images" / "red.png"
    picture.parent.mkdir()
    Image.new("RGB", (28, 28), (255, 0, 0)).save(picture)
    png = picture.read_bytes()
    (tmp_path / "images" / "cut.png").write_bytes(png[: len(png) // 2])
    source = tmp_path / "train.jsonl"

    def chat(*images, parts=None):
        content = parts or [{"type": "image"}] * len(images) + [{"type": "text", "text": "What colour?"}]
        return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Red."}],
                "images": list(images)}  # fmt: skip

    text_only = {"messages": [{"role": "user", "content": "No image."}, {"role": "assistant", "content": "Fine."}]}
    good = [chat("images/red.png"), chat({"bytes": png, "path": None}), chat(Image.open(picture)), chat(str(picture)),
            text_only]  # fmt: skip
    vision.check_records(good, source)  # nothing raised
    cases = {
        "`images[0]` (images/blue.png) cannot be read as an image": chat("images/blue.png"),
        "`images[0]` (images/cut.png) cannot be read as an image": chat("images/cut.png"),
        "2 image part(s) in `messages` but 1 image(s)": chat("images/red.png", parts=[{"type": "image"}] * 2),
        "`messages[0].content[0]` must be": chat("images/red.png", parts=[{"type": "picture"}]),
        # issue #66: a chat without an assistant turn stopped later without its file or record
        "its chat has no assistant turn, and only assistant turns train": {
            **chat("images/red.png"),
            "messages": chat("images/red.png")["messages"][:1],
        },
    }
    for expected, bad in cases.items():
        with pytest.raises(DataError) as error:
            vision.check_records([*good, bad], source)
        assert str(error.value).startswith(f"{source}: record 5: {expected}"), str(error.value)
        assert str(error.value).endswith("Fix or drop that record.")
    no_answer = cases["its chat has no assistant turn, and only assistant turns train"]
    vision.check_records([*good, no_answer], source, assistant_only=False)  # every token trains then: taken


@pytest.fixture(scope="module")
def demo_vlm(tmp_path_factory):
    """The vision-language demo built afresh (a few records), its tokenizer, image processor and model config."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from sft.tools import demo_vlm

    out = tmp_path_factory.mktemp("demo-vlm")
    demo_vlm.write_demo(out, n_train=24, n_eval=4)
    return out, AutoTokenizer.from_pretrained(out / "model"), AutoImageProcessor.from_pretrained(out / "model")


def test_the_demo_records_encode_and_pack_into_exact_rows(demo_vlm):
    """The demo's records through `check_records`, `encode` and `rows`: 4 image tokens per 56-pixel image, labels on
    the answer only, rows of at most max_length holding every record once, and a packed row of the demo's own
    Qwen2.5-VL (random weights) equal to its samples one at a time; a record over max_length is refused, named."""
    import datasets
    from transformers import AutoConfig, AutoModelForImageTextToText

    from sft.errors import DataError

    out, tokenizer, processor = demo_vlm
    source = out / "data" / "train.parquet"
    records = list(datasets.load_dataset("parquet", data_files=str(source), split="train"))
    vision.check_records(records, source)
    images = vision.Images(AutoConfig.from_pretrained(out / "model"), tokenizer, processor)
    samples = [vision.encode(r, tokenizer, images, source.parent) for r in records]
    image = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for record, s in zip(records, samples, strict=True):
        assert int((s.input_ids == image).sum()) == 4 and s.image_grid_thw.tolist() == [[1, 4, 4]]
        answer = record["messages"][1]["content"][0]["text"]
        assert tokenizer.decode(s.labels[s.labels != vision.IGNORE]) == answer + "<|end|>"
    lengths = [len(s.input_ids) for s in samples]
    packed_rows = vision.rows(lengths, 128)
    assert sorted(i for row in packed_rows for i in row) == list(range(len(samples)))
    assert all(sum(lengths[i] for i in row) <= 128 for row in packed_rows) and len(packed_rows) < len(samples) / 2
    with pytest.raises(DataError, match=r"record \d+: \d+ tokens with its image tokens, over `max_length: 30`"):
        vision.rows(lengths, 30)

    config = AutoConfig.from_pretrained(out / "model")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval().float()
    vision_hooks.join_positions(model)
    row = [samples[i] for i in packed_rows[0]]
    assert len(row) >= 3
    with torch.no_grad():
        logits = model(**vision.MRopePacker(model)(row), use_cache=False).logits[0]
        start = 0
        for s in row:
            alone = model(input_ids=s.input_ids[None], pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                          mm_token_type_ids=(s.input_ids == image).int()[None], use_cache=False).logits[0]  # fmt: skip
            assert torch.allclose(logits[start : start + len(s.input_ids)], alone, rtol=0, atol=1e-5)
            start += len(s.input_ids)


def test_the_shipped_vlm_demo_is_what_the_builder_makes(demo_vlm):
    """recipes/demo-vlm against `python -m sft.tools.demo_vlm`: the same tokenizer, image processor, model config and
    chat template files, and the same records (the generator's first records are the eval split)."""
    import datasets

    from tests.conftest import ROOT

    out, _, _ = demo_vlm
    shipped = ROOT / "recipes" / "demo-vlm"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                 "chat_template.jinja"):  # fmt: skip
        assert (shipped / "model" / name).read_text() == (out / "model" / name).read_text(), name
    fresh = datasets.load_dataset("parquet", data_files=str(out / "data" / "eval.parquet"), split="train")
    committed = datasets.load_dataset("parquet", data_files=str(shipped / "data" / "eval.parquet"), split="train")
    committed = committed.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))
    fresh = fresh.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))
    assert committed[:4] == fresh[:4]
    assert len(committed) == 200
    train = datasets.load_dataset("parquet", data_files=str(shipped / "data" / "train.parquet"), split="train")
    assert len(train) == 2000


def test_rows_are_best_fit_decreasing():
    """`rows` against best fit decreasing written plainly (every row scanned for the fullest one a sample fits):
    the same rows for random lengths."""
    import random

    def plain(lengths: list[int], max_length: int) -> list[list[int]]:
        packed, space = [], []
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

    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 300))]
        assert vision.rows(lengths, 128) == plain(lengths, 128)


def test_sft_varlen_runs_the_packed_row_and_the_encoder_exactly(packed_and_alone):
    """sft's varlen backend (what `auto` picks on a GPU; here its per-sample sdpa form) on the whole model: the
    vision encoder under the name that gets every image's boundaries in one call, each image attending to itself
    both ways; the packed row's logits equal eager's."""
    from sft.model import attention

    family, samples, batch, packed, _, _ = packed_and_alone
    model = tiny(family)
    attention.register_varlen()
    model.config._attn_implementation = attention.VARLEN  # the text and vision configs too
    assert attention.vision_encoder_on_varlen(model)
    assert model.config.vision_config._attn_implementation == attention.VISION_VARLEN
    assert model.config.get_text_config()._attn_implementation == attention.VARLEN
    calls = []
    hook = model.model.visual.blocks[0].attn.register_forward_hook(lambda *a: calls.append(1))
    vision_hooks.join_positions(model)
    with torch.no_grad():
        out = model(**batch, use_cache=False)
    hook.remove()
    assert len(calls) == 1  # one call for every image of the row
    assert torch.allclose(out.logits, packed.logits, rtol=0, atol=1e-5), (out.logits - packed.logits).abs().max()


def test_a_records_length_from_its_image_sizes_equals_its_encoding(demo_vlm, tmp_path):
    """`length` (what the start packs by: the images' sizes, no pixel processed) equals the tokens `encode` makes, for
    images the processor resizes up, down and to odd aspect ratios, one to three images a record."""
    from PIL import Image
    from transformers import AutoConfig, Qwen2VLImageProcessorPil

    out, tokenizer, demo_processor = demo_vlm
    config = AutoConfig.from_pretrained(out / "model")
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448, patch_size=14, merge_size=2,
                                         temporal_patch_size=2)  # fmt: skip
    sizes = [(56, 56), (30, 200), (300, 120), (1000, 24), (640, 480), (13, 13)]
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (i * 40, 90, 200)).save(tmp_path / f"{i}.png")
    for processor_ in (processor, demo_processor):
        for k in range(len(sizes)):
            images = [f"{j % len(sizes)}.png" for j in range(k, k + 1 + k % 3)]
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is it"}]
            record = {"messages": [{"role": "user", "content": parts},
                                   {"role": "assistant", "content": [{"type": "text", "text": "a square"}]}],
                      "images": images}  # fmt: skip
            layout = vision.Images(config, tokenizer, processor_)
            encoded = vision.encode(record, tokenizer, layout, tmp_path)
            assert vision.length(record, tokenizer, layout, tmp_path) == len(encoded.input_ids), (images, size)
    assert len({vision.image_tokens(processor, *s) for s in sizes}) >= 4  # the sizes make different token counts


def tiny_gemma3(window: int = 8):
    """A random four-layer Gemma 3 (three sliding-window layers of `window`, one full), a two-layer SigLIP encoder of
    56-pixel images (4 image tokens each), fp32."""
    import transformers as tf

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=4096,
                sliding_window=window, layer_types=["sliding_attention"] * 3 + ["full_attention"])  # fmt: skip
    encoder = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                   patch_size=14, vision_use_head=False)  # fmt: skip
    config = tf.Gemma3Config(text_config=text, vision_config=encoder, mm_tokens_per_image=4, image_token_index=IMAGE,
                             boi_token_index=START, eoi_token_index=END)  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.Gemma3ForConditionalGeneration(config).eval().float()


def test_gemma3_packs_exactly_with_sfts_own_masks():
    """Gemma 3's image tokens attend to their image both ways, its sliding layers see 8 tokens back: a row packed by
    `BlockMaskPacker` (sft's masks, per layer type) equals its samples alone (transformers' own masks) within 1e-5
    through eager and sdpa, the images' tokens included; transformers' masks on the same packed row do not (the leak
    that makes sft build its own)."""
    model = tiny_gemma3()
    gen = torch.Generator().manual_seed(1)

    def gemma_sample(before: int, image: bool, after: int):
        text = lambda n: torch.randint(3, 280, (n,), generator=gen)  # noqa: E731
        parts = [text(before)] + ([torch.tensor([START] + [IMAGE] * 4 + [END])] if image else []) + [text(after)]
        ids = torch.cat(parts)
        return vision.Sample(ids, ids.clone(), torch.randn(1, 3, 56, 56, generator=gen) if image else None)

    samples = [gemma_sample(5, True, 12), gemma_sample(3, False, 9), gemma_sample(9, True, 20),
               gemma_sample(2, True, 3)]  # fmt: skip
    with torch.no_grad():
        alone = []
        for s in samples:
            inputs = {"input_ids": s.input_ids[None], "token_type_ids": (s.input_ids == IMAGE).long()[None]}
            alone.append(model(**inputs, pixel_values=s.pixel_values, use_cache=False).logits[0])
        hook = vision_hooks.block_masks(model)  # sft's masks, built from the row's positions and token types
        for backend in ("eager", "sdpa"):
            model.set_attn_implementation(backend)
            batch = vision.BlockMaskPacker(model)(samples)
            assert "attention_mask" not in batch  # built on the model's device, not carried by the data loader
            packed = model(**batch, use_cache=False).logits[0]
            start = 0
            for s, out in zip(samples, alone, strict=True):
                n = len(s.input_ids)
                assert torch.allclose(packed[start : start + n], out, rtol=0, atol=1e-5), (backend, start)
                start += n
        hook.remove()
        theirs = model(**batch, use_cache=False).logits[0]
    assert (theirs - packed).abs().max() > 1e-2  # transformers' masks on the packed row: samples see each other


@pytest.mark.parametrize("family", ["smolvlm", "idefics3"])
def test_smolvlm_and_idefics3_records_pack_exactly_in_tiles(family, tmp_path):
    """The demo's records for a tiny SmolVLM (and Idefics3 of the same widths): each 56-pixel image resized to 64 and
    cut into 2 x 2 tiles and a global image, its prompt the processor's (`<fake_token_around_image><row_r_col_c>` and
    4 image tokens a tile, the global image last), `length` equal to the encoding; a row packed by `vision.packer`
    (positions restarting) equals its samples alone through eager and sdpa within 1e-5, and without the restarting
    positions the samples see each other."""
    import datasets
    import transformers as tf
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    from sft.tools import demo_vlm

    model_dir = demo_vlm.write_model(tmp_path, "smolvlm")
    config = AutoConfig.from_pretrained(model_dir)
    if family == "idefics3":
        config = tf.Idefics3Config(text_config=config.text_config.to_dict(), scale_factor=2,
                                   vision_config={**config.vision_config.to_dict(), "model_type": "idefics3_vision"},
                                   image_token_id=config.image_token_id)  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(config).eval()
    model.config.use_cache = model.config.text_config.use_cache = False  # as a run builds it: a cache drops the mask
    tokenizer, processor = AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir)
    source = ROOT / "recipes" / "demo-vlm" / "data" / "eval.parquet"
    records = datasets.load_dataset("parquet", data_files=str(source), split="train").select(range(4))
    images = vision.Images(config, tokenizer, processor)
    samples = [vision.encode(r, tokenizer, images, source.parent) for r in records]
    assert [vision.length(r, tokenizer, images, source.parent) for r in records] == [len(s.input_ids) for s in samples]
    text = tokenizer.decode(samples[0].input_ids)
    assert text.count("<image>") == 20 and "<row_2_col_2>" in text and text.count("<global-img>") == 1
    assert samples[0].pixel_values.shape == (5, 3, 32, 32) and samples[0].labels[-2] != vision.IGNORE
    with torch.no_grad():
        alone = [model(input_ids=s.input_ids[None], pixel_values=s.pixel_values[None],
                       pixel_attention_mask=s.pixel_attention_mask[None]).logits[0] for s in samples]  # fmt: skip
        batch = vision.packer(model)(samples)
        for backend in ("eager", "sdpa"):
            model.set_attn_implementation(backend)
            packed = model(**batch).logits[0]
            assert torch.allclose(packed, torch.cat(alone), rtol=0, atol=1e-5), backend
        leaked = model(**{k: v for k, v in batch.items() if k != "position_ids"}).logits[0]
    assert (leaked - packed).abs().max() > 1e-2


def test_gemma3_records_are_what_its_processor_makes(tmp_path):
    """A Gemma 3 record's ids equal Gemma3Processor's on its rendered chat (image expanded in the text, the whole text
    tokenized) with a byte-level BPE tokenizer whose newlines merge ("\\n" before the image and the expansion's
    "\\n\\n" become one "\\n\\n\\n" token, which tokenizing the expansion alone would not give), its pixels equal the
    processor's; the labels are the answer's tokens, or with `assistant_only` false every token but the image's."""
    import datasets
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from sft.tools import demo_vlm

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    corpus = ["hello world\n\n\nfoo\n\nbar\n", "What colour is the shape?\n\n\n", "a red circle\n\nyellow\n\n\n\n"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(corpus * 50, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<pad>"],
                                                             initial_alphabet=alphabet))  # fmt: skip
    marks = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>",
                                        extra_special_tokens=marks)  # fmt: skip
    tokenizer.add_tokens([*marks.values(), "<|user|>", "<|assistant|>", "<|end|>"], special_tokens=True)
    role = "<|{{ message['role'] }}|>"
    tokenizer.chat_template = demo_vlm.chat_template("<start_of_image>").replace(role, role + "\n")  # "\n" before
    assert len(tokenizer.encode("\n\n\n")) == 1 and len(tokenizer.encode("\n") + tokenizer.encode("\n\n")) == 2
    image_processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4)
    config = AutoConfig.from_pretrained(demo_vlm.write_model(tmp_path, "gemma3"))
    config.boi_token_index, config.image_token_index, config.eoi_token_index = tokenizer.convert_tokens_to_ids(
        list(marks.values()))  # fmt: skip
    source = ROOT / "recipes" / "demo-vlm" / "data" / "eval.parquet"
    records = datasets.load_dataset("parquet", data_files=str(source), split="train").select(range(3))
    images = vision.Images(config, tokenizer, image_processor)
    for record in records:
        sample = vision.encode(record, tokenizer, images, source.parent)
        theirs = processor(text=tokenizer.apply_chat_template(record["messages"], tokenize=False),
                           images=[vision.open_image(record["images"][0], source.parent).convert("RGB")],
                           return_tensors="pt")  # fmt: skip
        assert sample.input_ids.tolist() == theirs["input_ids"][0].tolist()
        assert torch.equal(sample.pixel_values, theirs["pixel_values"])
        assert vision.length(record, tokenizer, images, source.parent) == len(sample.input_ids)
        answer = record["messages"][1]["content"][0]["text"]
        assert tokenizer.decode(sample.labels[sample.labels != vision.IGNORE]) == answer + "<|end|>"
        every = vision.encode(record, tokenizer, images, source.parent, assistant_only=False)
        untrained = every.input_ids[every.labels == vision.IGNORE]
        assert set(untrained.tolist()) == images.image_ids and len(untrained) == 4 + 2  # the image's tokens only


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """The tiny Gemma 4 of `sft.tools.demo_vlm` (sliding and full layers, shared keys and values, per-layer inputs,
    images both ways in the sliding layers; 8-pixel patches pooled 2 x 2, at most 70 image tokens an image), random
    weights, fp32, with its tokenizer and image processor; and four records: images of three sizes (64, 66 and 56
    image tokens) and a text-only chat."""
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from sft.tools import demo_vlm

    model_dir = demo_vlm.write_model(tmp_path_factory.mktemp("gemma4"), "gemma4")
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    tokenizer, processor = AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir)

    def chat(size, question: str, answer: str) -> dict:
        user = [{"type": "image"}, {"type": "text", "text": question}] if size else question
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                "images": [Image.new("RGB", size, (200, 30, 30))] if size else []}  # fmt: skip

    records = [chat((56, 56), "What colour?", "red"), chat(None, "hello there, how are you today?", "fine"),
               chat((40, 72), "Shape?", "a tall one"), chat((90, 30), "Describe it", "wide")]  # fmt: skip
    return model_dir, model, tokenizer, processor, records


def test_gemma4_packs_exactly_with_sfts_own_masks(gemma4):
    """Gemma 4's image tokens attend to their image both ways in its sliding layers only, its images come in their own
    sizes: a row of the records (`vision.encode`, packed by `BlockMaskPacker`, sft's masks from `block_masks`) equals
    each record alone through transformers' own masks within 1e-5, through eager and sdpa, the images' tokens included;
    transformers' masks on the packed row do not (its samples see each other), and neither do masks that keep the
    images causal (what the sliding layers' both-ways attention changes)."""
    model_dir, model, tokenizer, processor, records = gemma4
    images = vision.Images(model.config, tokenizer, processor)
    samples = [vision.encode(r, tokenizer, images, model_dir) for r in records]
    image = model.config.image_token_id
    assert [int((s.input_ids == image).sum()) for s in samples] == [64, 0, 66, 56]
    with torch.no_grad():
        alone = []
        for s in samples:
            inputs = {"input_ids": s.input_ids[None], "mm_token_type_ids": (s.input_ids == image).long()[None]}
            if s.pixel_values is not None:
                inputs |= {"pixel_values": s.pixel_values, "image_position_ids": s.image_position_ids}
            alone.append(model(**inputs, use_cache=False).logits[0])
        alone = torch.cat(alone)
        hook = vision_hooks.block_masks(model)
        for backend in ("eager", "sdpa"):
            model.set_attn_implementation(backend)
            batch = vision.packer(model)(samples)
            assert "attention_mask" not in batch and batch["image_position_ids"].shape[0] == 3
            packed = model(**batch, use_cache=False).logits[0]
            assert torch.allclose(packed, alone, rtol=0, atol=1e-5), (backend, (packed - alone).abs().max())
        hook.remove()
        theirs = model(**batch, use_cache=False).logits[0]
        text = model.config.text_config
        causal = vision_hooks.masks(batch["position_ids"], batch["mm_token_type_ids"], text.sliding_window,
                                    text.layer_types, both_ways=())  # fmt: skip
        images_causal = model(**batch, attention_mask=causal, use_cache=False).logits[0]
    assert (theirs - alone).abs().max() > 1e-2 and (images_causal - alone).abs().max() > 1e-2


def test_gemma4_records_are_what_its_processor_makes(gemma4, monkeypatch):
    """A Gemma 4 record's ids, token types, pixels and patch positions equal Gemma4Processor's on its rendered chat
    (each image token replaced by begin, the image's soft tokens for its size, end), for images of three sizes; the
    length from the sizes alone equals the encoding; the labels are the answer's tokens and never an image's."""
    from transformers import Gemma4Processor

    model_dir, model, tokenizer, processor, records = gemma4
    # its audio and video processors left out (the video one needs torchvision, not installed): only its image and text
    # steps run, on text and images
    monkeypatch.setattr(Gemma4Processor, "check_argument_for_proper_class", lambda self, name, argument: argument)
    theirs_processor = Gemma4Processor(None, processor, tokenizer, None)
    images = vision.Images(model.config, tokenizer, processor)
    for record in records:
        sample = vision.encode(record, tokenizer, images, model_dir)
        text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
        theirs = theirs_processor(text=text, images=record["images"] or None, return_tensors="pt")
        assert sample.input_ids.tolist() == theirs["input_ids"][0].tolist()
        types = vision.packer(model)([sample])["mm_token_type_ids"][0]
        assert types.tolist() == theirs["mm_token_type_ids"][0].tolist()
        if record["images"]:
            assert torch.equal(sample.pixel_values, theirs["pixel_values"])
            assert torch.equal(sample.image_position_ids, theirs["image_position_ids"])
        assert vision.length(record, tokenizer, images, model_dir) == len(sample.input_ids)
        answer = record["messages"][1]["content"][0]["text"]
        assert tokenizer.decode(sample.labels[sample.labels != vision.IGNORE]) == answer + "<|end|>"
