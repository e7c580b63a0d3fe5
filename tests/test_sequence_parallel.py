"""Sequence parallelism, in-process: the CPU attention path, the sliceable batches, the checks, the plan and the batch
arithmetic. The runs that compare sp=2 with sp=1 are in tests/multiproc/test_sequence_parallel.py."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft.core import batch
from sft.core.dims import ParallelDims
from sft.errors import ConfigError
from sft.model import shapes
from sft.model.attention import boundaries_from_positions, varlen_attention_forward
from sft.parallel import sequence as seqpar
from sft.plan import fits as fitting
from sft.plan import memory as plan
from sft.plan.arguments import parse_args
from tests.conftest import DEMO, ROOT

DEMO_MODEL = ROOT / "recipes" / "demo" / "model"


def packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def test_per_sample_attention_equals_sdpa_with_the_block_mask():
    """sft_varlen on CPU (boundaries from position_ids, as Ulysses hands them over) = sdpa with the block-diagonal
    causal mask transformers builds for a packed row; GQA included."""
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    seq = sum(lengths)
    q, k, v = torch.randn(1, 4, seq, 8), torch.randn(1, 2, seq, 8), torch.randn(1, 2, seq, 8)
    positions = packed_positions(lengths)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.arange(seq)[:, None] >= torch.arange(seq)[None]
    mask = (causal & (sample[:, None] == sample[None]))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    ours, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.3, position_ids=positions)
    reference, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ours.shape == reference.shape == (1, seq, 4, 8)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    assert boundaries_from_positions(positions).tolist() == [0, 5, 6, 15, 18]


def test_sliceable_batch_pads_to_sp_only_and_keeps_real_lengths():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)
    examples = [{"input_ids": list(range(10, 10 + n)), "seq_lengths": [n]} for n in (7, 6)]
    shard = seqpar.ShardableCollator(collator, sp=4, pad_token_id=tokenizer.pad_token_id, trace=True)
    out = shard(examples)
    assert out["input_ids"].shape == (1, 16)  # 13 real tokens padded to the next multiple of 4, no further
    assert not set(seqpar.ROW_KEYS) & set(out)  # whole-row boundary tensors cannot be sliced: dropped
    info = out[seqpar.INFO_KEY]
    assert info.lengths == (7, 6) and info.tokens == 13 and info.padded == 16 and len(info.samples) == 2
    assert out["labels"][0, 13:].eq(-100).all() and out["position_ids"][0, 13:].eq(0).all()
    # the second sample straddles the split between sp ranks 1 and 2 (tokens 4..7 | 8..11)
    starts = boundaries_from_positions(out["position_ids"]).tolist()
    assert 4 < starts[1] < 8 < starts[2]
    assert starts == [0, 7, 13, 14, 15, 16]  # from the positions: each padding token a sample of its own
    # what the attention is handed with every micro-batch: the padding counted into the last sample, which leaves
    # the real tokens' attention as it is (causal: no real token sees the padding after it)
    given = seqpar.row_boundaries(info, "cpu")
    assert given["cu_seq_lens_q"].tolist() == [0, 7, 16] and given["max_length_q"] == 9
    module = types.SimpleNamespace(training=False)
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    merged, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.3, **given)
    apart, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.3, position_ids=out["position_ids"])
    torch.testing.assert_close(merged[:, :13], apart[:, :13], rtol=1e-5, atol=1e-6)  # fp32, other block shapes


def test_checks_name_the_setting_and_the_fix():
    llama = AutoConfig.from_pretrained(DEMO_MODEL)  # 4 heads, 2 key/value heads
    seqpar.check_model(llama, 2, "sft_varlen")
    with pytest.raises(ConfigError, match="attn_implementation: sdpa.*attend across samples"):
        seqpar.check_model(llama, 2, "sdpa")
    with pytest.raises(ConfigError, match="sequence_parallel_size: 3.*4 attention heads"):
        seqpar.check_model(llama, 3, "sft_varlen")
    with pytest.raises(ConfigError, match=r"MambaConfig \(mamba\) has none"):
        seqpar.check_model(AutoConfig.for_model("mamba"), 2, "sft_varlen")
    with pytest.raises(ConfigError, match="does not divide the 4 processes"):
        ParallelDims.build(4, 3)
    _, _, training_args, _ = parse_args(DEMO)
    dims = ParallelDims.build(2, 2)
    with pytest.raises(ConfigError, match="per_device_train_batch_size: 2.*one packed row"):
        seqpar.check(dims, training_args.run_engine, training_args, True)
    with pytest.raises(ConfigError, match="padding-free"):
        seqpar.check(dims, training_args.run_engine, training_args, False)
    _, _, no_ds, _ = parse_args([*DEMO, "--deepspeed", "none", "--per_device_train_batch_size", "1"])
    with pytest.raises(ConfigError, match="runs on DeepSpeed"):
        seqpar.check(dims, no_ds.run_engine, no_ds, True)
    with pytest.raises(ConfigError, match="sequence_parallel_size.*whole number"):
        parse_args([*DEMO, "--sequence_parallel_size", "two"])
    _, _, with_eval, _ = parse_args([*DEMO, "--per_device_train_batch_size", "1"])  # the demo evaluates each epoch
    with pytest.raises(ConfigError, match="eval_strategy: epoch.*wrong eval loss.*Set eval_strategy: no"):
        seqpar.check(dims, with_eval.run_engine, with_eval, True)


def test_plan_divides_activations_by_sp_and_suggests_the_smallest_sp():
    shape = shapes.load_shape(str(DEMO_MODEL))
    one = plan.estimate(shape, plan.Setting(gpus=2, seq_len=4096))
    two = plan.estimate(shape, plan.Setting(gpus=2, seq_len=4096, sp=2))
    assert two.items["activations"] == pytest.approx(one.items["activations"] / 2)
    assert fitting.sp_sizes(shape, 8) == (1, 2, 4)  # 4 heads, 2 key/value heads
    # memory for 1.5 x the sp=2 peak: sp=1 does not fit, sp=2 does, and is the answer
    memory = two.peak / 0.9 * 1.01
    base = plan.Setting(gpus=2, seq_len=4096)
    best = fitting.suggest(shape, base, memory, 0.1, (1,), [base], plan.MEMORY_LEVELS[:1], sp_choices=(1, 2))
    assert best is not None and best.setting.sp == 2


def test_batch_counts_the_global_batch_over_data_parallel_replicas(capsys):
    assert (
        batch.main(["--global-batch-size", "8", "--world-size", "8", "--per-device-batch-size", "1", "--sp", "2"]) == 0
    )
    out = capsys.readouterr().out
    assert "gradient_accumulation_steps: 2" in out and "data-parallel 4 x sequence-parallel 2" in out
