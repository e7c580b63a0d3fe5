"""Tiny models of the families the quick tier checks (2-4 layers, hidden 64): the config overrides per family and
the packed batch the architecture tests run, and the demo's model in the shapes the packing tests use. Shared by the
test modules that build them (tests/helpers.py's docstring)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft.data import vision
from tests.conftest import ROOT

WINDOW = 8
BASE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 256, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}  # fmt: skip
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
GROUPED = {"n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, **MOE}
GEMMA4 = {"sliding_window": WINDOW, "global_head_dim": 32, "layer_types": ["sliding_attention", "full_attention"] * 2}


# family -> config overrides: every family transformers ships of the model matrix, windows shorter than the samples
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, **MOE}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    "phi3": ("phi3", {"sliding_window": WINDOW}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", {"sliding_window": WINDOW}),  # three sliding layers to one full one
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2}),  # every other layer without rotary positions
    # Gemma 4: head dim 32 on its full layers (16 on the sliding ones), the last two layers reusing earlier layers'
    # keys and values with an MLP twice as wide, per-layer input embeddings; its MoE: experts beside the dense MLP,
    # keys equal to values on the full layers, with one key-value head there
    "gemma4": ("gemma4_text", {**GEMMA4, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                               "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256}),
    "gemma4_moe": ("gemma4_text", {**GEMMA4, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                   "moe_intermediate_size": 32, "attention_k_eq_v": True,
                                   "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 0}),
    "glm4_moe": ("glm4_moe", GROUPED),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}),
    "deepseek_v3": ("deepseek_v3", {**GROUPED, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                    "qk_nope_head_dim": 8, "v_head_dim": 12, "head_dim": 8, "num_key_value_heads": 4}),
}  # fmt: skip


LENGTHS = (13, 21, 5, 17)  # longer and shorter than the window


def config_of(name: str):
    model_type, extra = FAMILIES[name]
    return AutoConfig.for_model(model_type, **{**BASE, **extra})


def eager_and_compiled(eager, compiled, batch: dict) -> tuple[float, list[dict]]:
    """One forward and backward of `batch` through each model (the same weights, `compiled`'s decoder layers
    compiled): the largest logit difference, and each model's parameter gradients by name (compiled modules' prefix
    removed)."""
    outputs = [m(**batch) for m in (eager, compiled)]
    for out in outputs:
        out.loss.backward()
    grads = [{n.replace("_orig_mod.", ""): p.grad for n, p in m.named_parameters() if p.grad is not None}
             for m in (eager, compiled)]  # fmt: skip
    return float((outputs[0].logits - outputs[1].logits).abs().max()), grads


def packed_batch(vocab: int) -> dict:
    torch.manual_seed(1)
    rows = [{"input_ids": torch.randint(3, vocab, (n,)).tolist(), "seq_lengths": [n]} for n in LENGTHS]
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)


DEMO_MODEL = ROOT / "recipes" / "demo" / "model"
SHAPES = {
    "llama": {},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False},
}


def tiny_model(shape: str, use_cache: bool = False, backend: str = "sdpa"):
    config = AutoConfig.from_pretrained(DEMO_MODEL).to_dict()
    config.update(SHAPES[shape])
    config = AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=backend, dtype=torch.float32)
    model.config.use_cache = use_cache
    return model


# image+text families (tests/test_vision_packing.py, test_vision_run.py)
IMAGE, VIDEO, START, END = 290, 291, 292, 293
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
MROPE = {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def tiny(family: str) -> torch.nn.Module:
    """A random two-layer model of `family` (text and vision), eager attention, fp32."""
    import transformers as tf

    if family == "qwen2_vl":
        config = tf.Qwen2VLConfig(text_config={**TEXT, **MROPE},
                                  vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2,
                                                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                                  **TOKENS)  # fmt: skip
        model_class = tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(text_config={**TEXT, **MROPE},
                                     vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                                        out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                                        temporal_patch_size=2, window_size=56,
                                                        fullatt_block_indexes=[1]), **TOKENS)  # fmt: skip
        model_class = tf.Qwen2_5_VLForConditionalGeneration
    elif family in ("qwen3_5", "qwen3_5_moe"):  # linear attention on one of two layers, one sample at a time
        from sft.model import linear_attention

        rope = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
            "partial_rotary_factor": 1.0,
        }
        text = {
            **TEXT,
            "model_type": f"{family}_text",
            "head_dim": 16,
            "rope_parameters": rope,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        }
        if family == "qwen3_5_moe":
            text |= {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
            }
        config = tf.AutoConfig.for_model(family, text_config=text, vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64), **TOKENS)  # fmt: skip
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = tf.AutoModelForImageTextToText.from_config(config).eval().float()
        assert linear_attention.by_sample(model) == 1  # as the run's converter does
        return model
    else:
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        config = tf.Qwen3VLConfig(text_config={**TEXT, "head_dim": 16, "rope_parameters": rope},
                                  vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                                     temporal_patch_size=2, num_position_embeddings=64,
                                                     deepstack_visual_indexes=[0]), **TOKENS)  # fmt: skip
        model_class = tf.Qwen3VLForConditionalGeneration
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return model_class(config).eval().float()


def sample(gen: torch.Generator, before: int, grid: tuple[int, int, int] | None, after: int, patch_dim: int):
    """Text, an image of `grid` patches (its merged tokens between the vision start/end tokens), text; labels on the
    text after the image."""
    text = lambda n: torch.randint(3, 280, (n,), generator=gen)  # noqa: E731
    if grid is None:
        ids = text(before + after)
        return vision.Sample(ids, torch.where(torch.arange(len(ids)) >= before, ids, vision.IGNORE))
    t, h, w = grid
    ids = torch.cat([text(before), torch.tensor([START] + [IMAGE] * (t * h * w // 4) + [END]), text(after)])
    labels = torch.full_like(ids, vision.IGNORE)
    labels[-after:] = ids[-after:]
    return vision.Sample(ids, labels, torch.randn(t * h * w, patch_dim, generator=gen), torch.tensor([grid]))
