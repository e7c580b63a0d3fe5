"""Training FLOPs and MFU (sft.model.flops): the count against hand formulas and packed vs padded batches (the count in
a real run: tests/multiproc/test_metrics.py)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft.model.flops import FlopCounter, detect_peak_tflops, linear_flops_per_token
from tests.conftest import ROOT
from tests.tiny_models import tiny

DEMO_MODEL = ROOT / "recipes" / "demo" / "model"


def hand_linear_weights(config) -> int:
    """Weights of every matmul of a Llama, from its config: attention and MLP projections, and the output head."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return config.num_hidden_layers * per_layer + h * v


@pytest.mark.parametrize("tied", [False, True])
def test_linear_flops_count_decoder_and_head_not_the_embedding(tied):
    config = AutoConfig.from_pretrained(DEMO_MODEL, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    assert linear_flops_per_token(model) == 6 * hand_linear_weights(config)
    embedding = config.vocab_size * config.hidden_size
    total = sum(p.numel() for p in model.parameters())
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    assert hand_linear_weights(config) == total - norms - (0 if tied else embedding)


def test_lora_counts_frozen_layers_without_weight_gradients():
    config = AutoConfig.from_pretrained(DEMO_MODEL)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=["q_proj"]))
    q, h = config.num_attention_heads * config.head_dim, config.hidden_size
    lora = config.num_hidden_layers * 4 * (h + q)  # A: h -> 4, B: 4 -> q, per layer
    assert linear_flops_per_token(model) == 4 * hand_linear_weights(config) + 6 * lora


def test_packed_and_padded_batches_of_the_same_samples_count_the_same():
    """Attention is sum(len^2) over the samples of a packed row, never max_length^2."""
    config = AutoConfig.from_pretrained(DEMO_MODEL)
    counter = FlopCounter(AutoModelForCausalLM.from_config(config))
    lengths = [3, 5, 8, 1]
    samples = [{"input_ids": list(range(10, 10 + n))} for n in lengths]
    packed = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(samples)
    padded = DataCollatorForLanguageModeling(pad_token_id=0)(samples)
    assert "attention_mask" not in packed and packed["input_ids"].shape == (1, 17)
    assert padded["input_ids"].shape == (4, 8)
    expected = counter.per_token * 17 + 6 * config.num_hidden_layers * config.num_attention_heads * 32 * 99
    assert float(counter.batch_flops(packed)) == float(counter.batch_flops(padded)) == expected
    counter.add(packed)
    counter.add(padded)
    assert float(counter.take(torch.device("cpu"))) == 2 * expected
    assert float(counter.take(torch.device("cpu"))) == 0.0  # taken: the next window starts at zero


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H200", 989), ("NVIDIA A100-SXM4-80GB", 312),
     ("NVIDIA H100 PCIe", 756), ("Tesla T4", None)],
)  # fmt: skip
def test_peak_is_detected_from_the_device_name(name, peak):
    assert detect_peak_tflops(name) == peak


def test_compiled_decoder_layers_match_eager():
    """`compile_decoder_layers`: each decoder layer compiled; logits and gradients equal eager (fp32, CPU). Without a
    KV cache, as sft trains (a cache's per-layer state would recompile the layer's graph once per layer)."""
    from sft.errors import ConfigError
    from sft.model.converters import compile_decoder_layers

    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_MODEL, attn_implementation="sdpa"))
    compiled = AutoModelForCausalLM.from_config(eager.config)
    compiled.load_state_dict(eager.state_dict())
    compile_decoder_layers(compiled)
    ids = torch.randint(10, 100, (2, 24))
    outputs = [m(input_ids=ids, labels=ids, use_cache=False) for m in (eager, compiled)]
    for out in outputs:
        out.loss.backward()
    assert torch.allclose(outputs[0].logits, outputs[1].logits, atol=1e-5)
    grads = [dict(m.named_parameters())["model.layers.0.mlp.up_proj.weight"].grad for m in (eager, compiled)]
    assert torch.allclose(grads[0], grads[1], atol=1e-5) and grads[0].abs().sum() > 0
    with pytest.raises(ConfigError, match="has no decoder layers to compile"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_encoder_flops_equal_torchs_count_of_its_forward(family):
    """A frozen encoder (and projector) runs forward only: sft's count for a batch's images equals what torch's FLOP
    counter counts in the encoder's forward (matmuls, the patch convolution, attention within each image and window),
    images of uneven grids; the language model's per-token count leaves the encoder out."""
    from torch.utils.flop_counter import FlopCounterMode

    from sft.model import architectures
    from sft.model.flops import VisionFlops

    model = tiny(family)
    encoder = architectures.vision_encoder(model)
    encoder.requires_grad_(False)  # its projector too: nothing in it trains, every weight counted forward only
    grid = torch.tensor([[1, 4, 6], [1, 12, 8], [1, 2, 2]])  # 8 x 8 patches is one window of this Qwen2.5-VL
    dim = 3 * 2 * model.config.vision_config.patch_size**2
    pixels = torch.randn(int(grid.prod(-1).sum()), dim)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        encoder(pixels, grid_thw=grid)
    counted = VisionFlops(model, encoder)
    assert float(counted.flops(grid)) == pytest.approx(counter.get_total_flops(), rel=1e-9)
    text = linear_flops_per_token(model)
    everything = sum(6 * m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    in_encoder = sum(6 * m.in_features * m.out_features for m in encoder.modules() if isinstance(m, torch.nn.Linear))
    assert text == everything - in_encoder


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "smolvlm"])
def test_encoder_and_projector_beside_it_count_as_torch_counts_their_forward(family, tmp_path):
    """Gemma 3 (SigLIP encoder, a projector beside it pooling each image into `mm_tokens_per_image` tokens), Gemma 4
    (its own encoder, `embed_vision` beside it; images of their own sizes, counted from `image_position_ids`: here two
    whose patches fill its 280 without padding, which sft does not count) and SmolVLM (tiles, a connector shuffling 4
    patches into one token), frozen: sft's count for a batch's images equals torch's count of `get_image_features`
    (encoder and projector), and the per-token count leaves both out."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForImageTextToText

    from sft.model import architectures
    from sft.model.flops import FlopCounter
    from sft.tools import demo_vlm

    config = AutoConfig.from_pretrained(demo_vlm.write_model(tmp_path, family))
    config._attn_implementation = "eager"  # torch's counter counts eager's attention matmuls (not CPU sdpa's kernel)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.requires_grad_(False)  # encoder and projector forward only
    pixels = torch.randn(3, 3, 56, 56) if family == "gemma3" else torch.randn(1, 5, 3, 32, 32)
    inputs = {"pixel_values": pixels, "input_ids": torch.zeros(1, 0, dtype=torch.long)}
    if family == "gemma4":  # 160 x 112 and 112 x 160 pixels: 20 x 14 and 14 x 20 patches of 8, no padding
        from PIL import Image
        from transformers import AutoImageProcessor

        processed = AutoImageProcessor.from_pretrained(tmp_path)(
            [Image.new("RGB", (160, 112)), Image.new("RGB", (112, 160))], return_tensors="pt"
        )
        inputs = {k: processed[k] for k in ("pixel_values", "image_position_ids")}
        assert (inputs["image_position_ids"] >= 0).all()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model.get_image_features(*inputs.values() if family == "gemma4" else [pixels])
    counted = FlopCounter(model)
    assert float(counted.vision.flops(counted.vision.grids(inputs))) == pytest.approx(counter.get_total_flops(),
                                                                                         rel=1e-9)  # fmt: skip
    encoder, projector = architectures.vision_encoder(model), architectures.vision_projector(model)
    assert type(encoder).__name__ == {"gemma3": "SiglipVisionModel", "gemma4": "Gemma4VisionModel",
                                      "smolvlm": "SmolVLMVisionTransformer"}[family]  # fmt: skip
    frozen = [n for n, _ in architectures.vision_tower_parameters(model)]
    inside = {"gemma3": ".vision_tower.", "gemma4": ".vision_tower.", "smolvlm": ".vision_model."}[family]
    assert frozen and all(inside in f".{n}" for n in frozen) and not any(
        part in n for n in frozen for part in ("projector", "connector", "embed_vision"))  # fmt: skip
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]  # all frozen here: 4 x (no weight grad)
    beside = {id(m) for part in (encoder, projector) for m in part.modules()}
    assert counted.per_token == sum(4 * m.in_features * m.out_features for m in linears if id(m) not in beside)


def test_attention_pairs_are_weighed_by_each_layers_head_dim_and_skip_linear_attention():
    """Gemma 4's full layers (head dim 512 of a 299 mean, no window) count 512 / 299 of their pairs, its sliding ones
    (256, a window of 512) 256 / 299 of theirs; Qwen3.5's linear-attention layers count none, its full one len^2 / 2;
    Llama's every layer len^2 / 2."""
    from sft.model import architectures

    lengths = torch.tensor([1000.0, 300.0])
    full = (1000**2 + 300**2) / 2
    windowed = 512**2 / 2 + (1000 - 512) * 512 + 300**2 / 2
    gemma4 = architectures.of(AutoConfig.for_model("gemma4_text"))
    expected = (5 * 512 * full + 25 * 256 * windowed) / gemma4.head_dim
    assert gemma4.head_dim == 299 and float(gemma4.attention_pairs(lengths)) == pytest.approx(expected, rel=1e-12)
    types = ["linear_attention"] * 3 + ["full_attention"]
    qwen = architectures.of(AutoConfig.for_model("qwen3_5_text", num_hidden_layers=4, layer_types=types))
    assert qwen.attention.softmax == (False, False, False, True) and float(qwen.attention_pairs(lengths)) == full
    llama = architectures.of(AutoConfig.for_model("llama", num_hidden_layers=3))
    assert float(llama.attention_pairs(lengths)) == 3 * full


@pytest.mark.full
@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe", "glm4_moe", "gpt_oss"])
def test_compiled_layers_match_eager_on_a_packed_row(family):
    """The compiled decoder layers of the families whose `compile_bf16` was measured (on by default on a GPU for
    dense Gemma 4 and GLM-4-MoE: `KERNELS`; off for Gemma 4's MoE) and of gpt-oss, whose sinks' attention stays out
    of the layer's graph (`sft.model.attention.scored_attention`), on a packed row through `sft_varlen`: logits and
    every parameter's gradient equal eager (fp32, CPU; a full-tier repeat of `test_compiled_decoder_layers_match_eager`
    for the families whose layers it turns on, 50-110 s of compiling each)."""
    from sft.model.attention import VARLEN, register_varlen
    from sft.model.converters import compile_decoder_layers
    from tests.tiny_models import config_of, eager_and_compiled, packed_batch

    register_varlen()
    config = config_of(family)
    torch.manual_seed(0)
    eager, compiled = (AutoModelForCausalLM.from_config(config, attn_implementation=VARLEN) for _ in range(2))
    compiled.load_state_dict(eager.state_dict())
    compile_decoder_layers(compiled)
    batch = {k: v for k, v in packed_batch(config.vocab_size).items() if k != "seq_idx"}
    logits, grads = eager_and_compiled(eager, compiled, batch)
    assert logits < 1e-5
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    assert max(float((grads[0][n] - grads[1][n]).norm() / grads[0][n].norm()) for n in grads[0]) < 5e-5
