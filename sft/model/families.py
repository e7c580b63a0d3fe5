"""Every model family sft knows, one record each (`Family`, in `FAMILIES` by transformers' `model_type`): the kernels
measured on it and their status (`Kernel`: Liger, FP8, compiled layers, sft's experts, the speed model; a mixture of
experts' own where they differ), what its decoder layer keeps for the backward beyond Llama's (`LayerKeeps`), what its
attention asks of a backend (logit soft-capping, sinks, a mask built without positions, Gated DeltaNet layers run one
sample at a time, sparse attention that padding changes), its MLP's kept tensors, an image+text family's packing and
image tokens (`Vision`), and the hub ids whose configs sft ships for `sft plan` offline (sft/model/model_configs.json).
`sft.model.architectures`' tables (`KERNELS`, `LAYER_KEEPS`, `VISION`, `SOFTCAP_FAMILIES`, ...) are views of these
records; a new family is a record here (`sft.model.architectures.register` for one outside sft) and its tests
(docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple


class Kernel(NamedTuple):
    on: bool
    reason: str
    # its tokens/s against plain bf16's at the same micro batch, where measured (Liger: `benchmarks/architectures.py`);
    # the speed model weighs it against what the kernel frees (`sft.plan.speed`: a kernel's worth is the fastest
    # setting it makes possible, not its speed at a fixed micro batch)
    speedup: float | None = None


class LayerKeeps(NamedTuple):
    """What a decoder layer keeps for the backward besides its attention's and its MLP's tensors, by how the family
    builds the layer; the memory plan counts it (`sft.plan.memory.layer_bytes_per_token`), checked against autograd's
    saved-tensor hooks for every family (tests/test_plan.py on the CPU; with Liger on a GPU,
    benchmarks/results/layer_activations)."""

    norms: int = 2  # RMSNorms on the residual stream per layer (Gemma 2/3: 4, before and after each sublayer)
    fp32_scale: bool = False  # the norm scales in fp32 (Gemma, OLMo 2): its fp32 input and fp32 result are kept
    qk_norm: str | None = None  # "head": an RMSNorm per head on q and k (Qwen3, Gemma 3); "width": over the whole
    # projection (OLMo 2); None: none
    fused_qkv: bool = False  # one qkv projection (Phi-3): its output stays alive through the values' view of it
    residual_dropout: bool = False  # nn.Dropout on each sublayer's output (Phi-3): a 1-byte mask per element, even at
    # p = 0 (not kept under Liger's patches: measured, benchmarks/results/layer_activations)
    liger_qk_norm: bool = True  # Liger's patches of a model instance replace the q and k norms (OLMo 2's do not:
    # liger-kernel 0.8.5's `apply_liger_kernel_to_olmo2` patches only the post-norms; transformers' stay)
    v_norm: bool = False  # an RMSNorm without scale per head on the values too (Gemma 4)
    per_layer_input: int = 0  # the width of Gemma 4's per-layer input embeddings (PLE) that each layer gates in
    output_gate: bool = False  # the attention's output times a sigmoid gate from the query projection (Qwen3.5,
    # Qwen3-Next): the gate and the gated output kept besides the attention's output
    # Gated DeltaNet layers (Qwen3.5, Qwen3-Next): (such layers, key heads, key head dim, value heads, value head dim);
    # () where none
    linear: tuple[int, ...] = ()
    # layers that reuse an earlier layer's keys and values (Gemma 4's `num_kv_shared_layers`, the last ones): (such
    # layers, their key-value heads x head dim summed, their key-value heads summed); () where none. They keep no key
    # or value of their own, nor their norms' (tests/test_plan.py)
    kv_shared: tuple[int, ...] = ()


@dataclass(frozen=True)
class Vision:
    """An image+text family as sft trains it (`VISION`, its one table): how its packed rows keep samples apart
    (`sft.data.vision`'s packer of that name) and how its images become tokens."""

    # "mrope": per-sample M-RoPE rows and a boundary row (Qwen-VL); "positions": 1-D positions restarting at each
    # sample; "masks": sft's own attention masks, each sample causal and its images both ways (Gemma 3)
    packing: str
    # every run image+text (built with transformers' image-text-to-text class); else a multimodal config fine-tuned on
    # text alone as often: image+text where the data has images (`images` in its records), a text run otherwise
    always: bool
    tiles: bool = False  # images cut into tiles, each image's prompt from its rows and columns (SmolVLM, Idefics3)
    text_expansion: bool = False  # its image tokens written into the rendered text (begin/end of image: Gemma 3)
    # "masks" only: the layer types in which an image's tokens attend to each other both ways (Gemma 3: every layer;
    # Gemma 4: the sliding ones), only where the text config's (field, value) of `both_ways_if` holds (Gemma 4's
    # `use_bidirectional_attention: vision`), and the batch key of the token types the model takes (1 on image tokens)
    both_ways: tuple[str, ...] = ("full_attention", "sliding_attention")
    both_ways_if: tuple[str, str] | None = None
    type_ids: str = "token_type_ids"
    framed: bool = False  # each image's tokens between its begin and end tokens, counted from its size (Gemma 4)


GENERIC = "never measured on a GPU: every fast path off"
RESULTS = "benchmarks/results/architectures, 1 x H100, 2 layers at the family's widths"
# Liger's patches exist per model type (liger_kernel.transformers.monkey_patch). `benchmarks/architectures.py` measured
# each family against its plain bf16 run: every Liger run finite and within 0.06% of plain's loss per step; on where
# it was also faster. FP8 measured slower than bf16 at 2 layers for every family, Llama's too (0.49x eager, 0.63x
# compiled), where its full-depth runs gain 1.04-1.16x (benchmarks/results/fp8): so FP8 stays on only for Llama,
# measured at full depth, until another family is. Compiled layers follow FP8 (`compile_decoder_layers: auto`), or
# are on alone where `compile_bf16` was measured faster (a MoE's elementwise work between its grouped GEMMs).
LLAMA_MEASURED = Kernel(True, "measured exact and faster at full depth on the Llama shapes (benchmarks/results/fp8, "
                        "throughput)")  # fmt: skip
FP8_UNMEASURED = Kernel(False, f"slower than bf16 at 2 layers ({RESULTS}; so was Llama's, which gains only at full "
                        "depth); not yet measured at full depth")  # fmt: skip
COMPILE_WITH_FP8 = Kernel(False, "on only with FP8")


# sft's experts implementation (`sft.model.experts`) against transformers' grouped_mm, sft's defaults otherwise (1 x
# H100, benchmarks/results/moe_h100): one layer forward + backward 1.11x (Qwen3-30B-A3B widths) and 1.04x
# (gpt-oss-20b); the whole eager model 1.03x (Qwen3-MoE) and 1.02x (gpt-oss); under compiled layers 0.996x (Inductor
# fuses transformers' elementwise work)
MOE_RESULTS = "benchmarks/results/moe_h100"
EXPERTS_GPT_OSS = Kernel(True, f"sft_grouped: equal to the per-expert loop, 1.04x transformers' grouped_mm per layer, "
                         f"1.02x the whole model ({MOE_RESULTS})")  # fmt: skip
EXPERTS_UNDER_COMPILE = Kernel(False, f"equal to transformers' grouped_mm under compiled layers (0.996x its tokens/s, "
                               f"{MOE_RESULTS})")  # fmt: skip


def _liger(speed: float) -> Kernel:
    """Liger measured exact on the family at `speed` x plain bf16's tokens/s (2 layers, the same micro batch): on by
    itself where not slower; elsewhere a candidate the plan's ranking takes where what it frees (the logits, the
    norms' and SwiGLU's activations) buys a faster setting (`sft.plan.preflight`)."""
    if speed >= 1.0:
        return Kernel(True, f"finite, loss within 0.06% of plain bf16, {speed:.2f}x its tokens/s ({RESULTS})", speed)
    why = f"finite and exact but {speed:.2f}x plain bf16's tokens/s at the same micro batch ({RESULTS})"
    return Kernel(False, why, speed)


UNMEASURED = "not yet measured for this family on a GPU"
RESULTS_2026 = "benchmarks/results/families_2026"
# `speed`: the plan ranks what fits by its speed model (`sft.plan.speed`) for every family sft knows and every
# vision-language family: the terms (matmul and attention FLOPs, recomputation, per-layer host work, ZeRO's gradient
# work, collectives, the optimizer step) come from the model's shapes, the card's constants are shared across families
# (fitted on Llama widths; a family gets its own only where a measurement shows it differs). Only the generic path
# (a family sft has not checked) keeps the plan's rule: the largest micro batch with the fewest levers.
SPEED_MEASURED = Kernel(True, "the speed model's constants were fitted on Llama widths (1B, 3B; "
                        "benchmarks/results/speed_sweep_h100)")  # fmt: skip
SPEED_FROM_SHAPES = Kernel(True, "the speed model's terms from this model's shapes, the card's constants shared with "
                           "Llama's (benchmarks/results/speed_sweep_h100)")  # fmt: skip


@dataclass(frozen=True)
class Family:
    """What sft knows of one `model_type`. `kernels` None: not in sft's architecture table (the generic path: every
    fast path off, its packing not checked by the suite); `{}`: packed exactly by the suite, no kernel measured yet."""

    model_type: str
    kernels: Mapping[str, Kernel] | None = None
    kernels_moe: Mapping[str, Kernel] = field(default_factory=dict)  # its MoE configs' where they differ
    keeps: LayerKeeps | None = None  # None: Llama's layer (a q/k norm where its layers have one)
    norms_from_modules: bool = False  # its residual-stream norms counted from a layer's modules (Gemma 4)
    softcap: bool = False  # passes `softcap` to the attention function (Gemma 2)
    sinks: bool = False  # passes `s_aux`, a learned sink logit per head (gpt-oss)
    mask_without_positions: bool = False  # transformers builds its mask without position_ids: masks are not packed
    gated_deltanet: bool = False  # its linear-attention layers are Gated DeltaNet, run one sample at a time
    padding_changes_attention: bool = False  # padding changes what a padded row's tokens attend to (GLM-5's indexer)
    mlp_kept: int = 0  # [tokens, intermediate] tensors its MLP keeps where not SwiGLU's 4
    vision: Vision | None = None  # an image+text family (keyed by its top-level model_type)
    shipped: tuple[str, ...] = ()  # the hub ids whose configs sft ships (model_configs.json), planned offline


# The families, in the order of docs/models.md. Liger's patches exist per model type
# (liger_kernel.transformers.monkey_patch); `_liger(x)`: measured exact at x times plain bf16's tokens/s (2 layers)
FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (  # fmt: skip
        Family(
            "llama",
            {"liger": LLAMA_MEASURED, "fp8": LLAMA_MEASURED, "compile": LLAMA_MEASURED, "speed": SPEED_MEASURED},
            shipped=(
                "meta-llama/Llama-3.2-1B",
                "meta-llama/Llama-3.2-3B",
                "meta-llama/Llama-3.1-8B",
                "meta-llama/Llama-3.1-70B",
            ),
        ),
        Family(
            "qwen2",
            {"liger": _liger(0.86), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},  # windowed: 0.93
            shipped=("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-72B"),
        ),
        Family(
            "qwen3",
            {"liger": _liger(0.996), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
            keeps=LayerKeeps(qk_norm="head"),
            shipped=("Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "Qwen/Qwen3-14B", "Qwen/Qwen3-32B"),
        ),
        Family(
            "mistral",
            {"liger": _liger(1.16), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
            shipped=("mistralai/Mistral-7B-v0.3",),
        ),
        Family(
            "gemma2",
            {"liger": _liger(1.32), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
            keeps=LayerKeeps(norms=4, fp32_scale=True),
            softcap=True,
            shipped=("google/gemma-2-2b", "google/gemma-2-9b", "google/gemma-2-27b"),
        ),
        Family(
            "gemma3_text",
            {"liger": _liger(1.47), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
            keeps=LayerKeeps(norms=4, fp32_scale=True, qk_norm="head"),
            shipped=("google/gemma-3-12b", "google/gemma-3-4b"),
        ),
        Family(
            "phi3",
            {"liger": _liger(1.17), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
            keeps=LayerKeeps(fused_qkv=True, residual_dropout=True),
            shipped=("microsoft/Phi-3-mini-4k-instruct",),
        ),
        Family(
            "olmo2",
            {"liger": _liger(1.09), "fp8": FP8_UNMEASURED, "compile": COMPILE_WITH_FP8},
            keeps=LayerKeeps(fp32_scale=True, qk_norm="width", liger_qk_norm=False),
            shipped=("allenai/OLMo-2-1124-7B",),
        ),
        # gpt-oss's gate: the [gate, up] pairs kept by both clamps, the clamped gate, its sigmoid, up + 1, the GLU and
        # down's input (7); transformers 5.x's gpt-oss calls create_causal_mask without position_ids: its
        # sdpa/eager/flex masks are not packed
        Family(
            "gpt_oss",
            {
                "liger": _liger(1.12),
                "fp8": FP8_UNMEASURED,
                "compile": Kernel(
                    False,
                    "compiled layers fail in the first backward (Inductor's assert_size_stride: wrong "
                    f"number of dimensions; torch 2.11, {MOE_RESULTS}; again on 1 x H200, {RESULTS_2026})",
                ),
                "experts": EXPERTS_GPT_OSS,
            },
            sinks=True,
            mask_without_positions=True,
            mlp_kept=7,
            shipped=("openai/gpt-oss-20b",),
        ),
        # mixture of experts: FP8 converts only the attention projections (the experts are 3-D weights, not nn.Linear;
        # their float8 grouped GEMMs, `sft.model.experts.NAME_FP8`, measured 0.75x bf16 per layer:
        # benchmarks/results/moe_h100)
        Family(
            "qwen3_moe",
            {
                "fp8": Kernel(False, f"converts only the attention projections; 0.86x bf16 ({RESULTS})"),
                "experts": EXPERTS_UNDER_COMPILE,
                "compile_bf16": Kernel(
                    True,
                    f"1.39x the eager layers' tokens/s at Qwen3-30B-A3B's widths, loss within 1e-5 ({MOE_RESULTS})",
                ),
            },
            keeps=LayerKeeps(qk_norm="head"),
            shipped=("Qwen/Qwen3-30B-A3B",),
        ),
        Family("mixtral", {}),
        # packed exactly (tests/test_architectures.py); no kernel measured on a GPU yet. OLMo 3: OLMo 2's layer,
        # windowed
        Family("olmo3", {}, keeps=LayerKeeps(fp32_scale=True, qk_norm="width", liger_qk_norm=False)),
        Family("smollm3", {}),
        # packed exactly, dense and MoE, its per-layer head dims and shared keys and values
        # (tests/test_architectures.py); its norms counted from a layer's modules
        # (`sft.model.architectures.layer_keeps`)
        Family(
            "gemma4_text",
            {
                # Liger 0.8.5's patch: exact eager (losses within 4.1e-4 of plain bf16 over 6 steps) and 1.08x plain's
                # tokens/s at 2 layers, but a wrong loss under compiled layers (16.7 -> 25.9 after one step, the same
                # in a model built after Liger patched the classes), which are on for Gemma 4 and faster (1 x H200,
                # RESULTS_2026: architectures_call9_liger.json, compile_rows_call10_gemma4.json: compiled layers
                # without Liger equal eager)
                "liger": Kernel(
                    False,
                    "exact but 1.08x plain bf16 eager where compiled layers, which it breaks, give 1.40x "
                    f"(1 x H200, {RESULTS_2026})",
                ),
                "liger_compiled": Kernel(
                    False,
                    "Liger's Gemma 4 patch under compiled decoder layers trained a wrong loss "
                    f"(25.9 against eager's 16.7 after one step, 1 x H200, {RESULTS_2026})",
                ),
                # its seven RMSNorms per layer in fp32, GELU gate and per-layer inputs fused: 1.40x the eager layers'
                # tokens/s at 8 layers of its widths (58,703 against 42,033, ZeRO-2, one call; 0.40 s of elementwise
                # kernels per 1.48 s step down to 0.03), loss within 7e-4 of eager per step in bf16, equal in fp32
                # (tests/test_flops.py)
                "compile_bf16": Kernel(
                    True,
                    "1.40x the eager layers' tokens/s at 8 layers of Gemma 4's widths, 1 x H200; "
                    f"equal to eager in fp32 ({RESULTS_2026})",
                ),
            },
            kernels_moe={
                # Gemma 4's MoE with compiled layers: equal to eager in fp32 on the CPU (tests/test_flops.py), but its
                # first step's gradient norm was NaN in bf16 at 8 layers of its widths (1 x H200,
                # compiled_failures_calls12_15.txt), so they stay off there; asked for by name they are kept, with this
                # reason in the log, and sft's non-finite check stops the run
                "compile_bf16": Kernel(
                    False,
                    "compiled layers trained a NaN gradient norm at the first step of Gemma 4's "
                    f"MoE (bf16, 8 layers, 1 x H200, {RESULTS_2026}); equal to eager in fp32 on the "
                    "CPU",
                ),
            },
            keeps=LayerKeeps(norms=4, fp32_scale=True, qk_norm="head"),
            norms_from_modules=True,
        ),
        # its compiled layers at 8 layers of its widths, sft's one-GPU plan, one call: 63,680 tokens/s against eager's
        # 50,748 (1.25x; MFU 0.342, 0.79 of Llama's), losses within 5.2e-5 of eager's per step (bf16, the same start);
        # equal in fp32 on the CPU (tests/test_flops.py)
        Family(
            "glm4_moe",
            {
                "liger": Kernel(False, "Liger has no patches for glm4_moe"),
                "compile_bf16": Kernel(
                    True,
                    "1.25x the eager layers' tokens/s at 8 layers of GLM-4-MoE's widths, losses within 5.2e-5 of "
                    f"eager's, 1 x H200; equal to eager in fp32 ({RESULTS_2026})",
                ),
            },
        ),
        # Gated DeltaNet on three of four layers: packed rows equal their samples alone, values and gradients, dense
        # and MoE (tests/test_linear_attention.py); fla's varlen kernels where they train
        # (`sft.model.linear_attention`) compiled layers (the Gated DeltaNet token mixer outside their graph,
        # `sft.model.linear_attention`) without Liger: 37,380 tokens/s a step once compiled (MFU 0.42) at 8 layers of
        # its widths under sft's one-GPU plan, against 28,934 eager with Liger (1.29x), losses alike; with FP8 and
        # Liger under compiled layers 21,800 (1 x H100, Triton 3.6, fla with sft's piece; RESULTS_2026, item 24).
        # Gemma's norm (1 + weight, in fp32) on the residual stream and per head; the gated attention output; their
        # linear layers read from the config (`layer_keeps`)
        Family(
            "qwen3_5_text",
            {
                # no `speedup`: not a candidate of the plan's ranking either (its 1.07x was measured eager; beside
                # compiled layers it was measured only with FP8)
                "liger": Kernel(
                    False,
                    "exact (losses within 4e-5 of plain bf16, 1.07x its tokens/s eager), but compiled layers without "
                    f"it train at 1.29x the eager Liger run's tokens/s (1 x H100, {RESULTS_2026})",
                ),
                "compile_bf16": Kernel(
                    True,
                    "1.29x the eager layers' (with Liger) tokens/s a step at 8 layers of Qwen3.5's widths, 1 x H100; "
                    f"equal to eager in fp32 on the CPU ({RESULTS_2026})",
                ),
            },
            keeps=LayerKeeps(fp32_scale=True, qk_norm="head", output_gate=True),
            gated_deltanet=True,
        ),
        Family(
            "qwen3_5_moe_text",
            {
                "compile_bf16": Kernel(
                    False,
                    "compiled layers beside fla's kernels had not finished one step after 130 s at 8 layers of its "
                    f"widths (1 x H200, {RESULTS_2026})",
                )
            },
            keeps=LayerKeeps(fp32_scale=True, qk_norm="head", output_gate=True),
            gated_deltanet=True,
        ),
        Family("deepseek_v3", {}),
        # not in the table (the generic path), with what their attention asks known
        Family("qwen3_next", keeps=LayerKeeps(fp32_scale=True, qk_norm="head", output_gate=True), gated_deltanet=True),
        # GLM-5's indexer (`glm_moe_dsa`, transformers 5.24) takes its top-k keys before the padding mask, so padding
        # positions take places the real keys would have (tests/test_sparse_attention.py): trained one unpadded row per
        # micro batch
        Family("glm_moe_dsa", padding_changes_attention=True),
        # image+text families (their top-level model_type; the text model's is planned by its own record or the generic
        # path): their packing and image tokens
        Family("qwen2_vl", vision=Vision("mrope", always=True)),
        Family("qwen2_5_vl", vision=Vision("mrope", always=True), shipped=("Qwen/Qwen2.5-VL-7B",)),
        Family("qwen3_vl", vision=Vision("mrope", always=True)),
        Family("smolvlm", vision=Vision("positions", always=True, tiles=True)),
        Family("idefics3", vision=Vision("positions", always=True, tiles=True)),
        # Gemma 3's 4B-27B checkpoints are `gemma3` configs
        Family("gemma3", vision=Vision("masks", always=False, text_expansion=True)),
        # Gemma 4 (dense, MoE): image tokens per image from its size, both ways in the sliding layers only
        Family(
            "gemma4",
            vision=Vision(
                "masks",
                always=False,
                both_ways=("sliding_attention",),
                framed=True,
                type_ids="mm_token_type_ids",
                both_ways_if=("use_bidirectional_attention", "vision"),
            ),
        ),
        # Qwen3.5 and Qwen3.6 (dense, MoE): image+text checkpoints often fine-tuned on text; their linear-attention
        # layers run one sample at a time (`sft.model.linear_attention`) in image rows too
        Family("qwen3_5", vision=Vision("mrope", always=False)),
        Family("qwen3_5_moe", vision=Vision("mrope", always=False)),
    )
}
