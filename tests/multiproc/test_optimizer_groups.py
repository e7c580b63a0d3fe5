"""ZeRO-1/2 with torchao's 8-bit AdamW steps groups of at most `STEP_GROUP_PARAMS` parameters
(`sft.engines.deepspeed.zero.split_optimizer_groups`, issue #65): DeepSpeed flattens and steps each group apart, so its
step holds one group's fp32 gradient and dequantised moments, not the whole partition's. The split must not change
what is trained: the same steps through DeepSpeed ZeRO-2 (one gloo process, bf16) with one group and with three give
the same weights, and 8-bit moments in both (every group's flat partition a multiple of torchao's 256-element
block)."""

from __future__ import annotations

import subprocess
import sys

import torch

from sft.engines.deepspeed.zero import split_optimizer_groups
from tests.conftest import ROOT

SCRIPT = r"""
import copy, json, os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed, torch
from torchao.optim import AdamW8bit
from sft.engines.deepspeed.zero import skip_cpu_shared_memory_op, split_optimizer_groups

skip_cpu_shared_memory_op()  # as sft's runs do: DeepSpeed would compile its shared-memory op (~100 CPU-s) otherwise
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.ReLU(),
                            torch.nn.Linear(512, 256, bias=False), torch.nn.Linear(256, 64, bias=False))
config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True}
x = torch.randn(2, 256)
out = {}
for limit in (None, 140_000):
    copy_ = copy.deepcopy(model)
    optimizer = AdamW8bit(copy_.parameters(), lr=1e-2)
    added = split_optimizer_groups(optimizer, limit) if limit else 0
    engine, zero, _, _ = deepspeed.initialize(model=copy_, optimizer=optimizer, config=config)
    losses = []
    for _ in range(4):
        loss = engine(x.bfloat16()).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    states = sorted({type(v).__name__ for s in zero.optimizer.state.values() for v in s.values()})
    weights = [p.float().flatten()[:2000].tolist() for p in engine.module.parameters()]
    out[str(limit)] = {"added": added, "groups": len(zero.optimizer.param_groups), "losses": losses,
                       "states": states, "weights": weights}
print("RESULT " + json.dumps(out))
"""


def test_split_groups_keep_hyperparameters_and_order():
    """Groups close before they would pass the limit, a parameter is never cut, each keeps its group's settings."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 300, 500, 100, 900)]
    optimizer = torch.optim.AdamW([{"params": params[:4], "weight_decay": 0.1}, {"params": params[4:]}], lr=1e-3)
    assert split_optimizer_groups(optimizer, 700) == 1  # groups added
    assert [[p.numel() for p in g["params"]] for g in optimizer.param_groups] == [[300, 300], [500, 100], [900]]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.01]
    assert [p for g in optimizer.param_groups for p in g["params"]] == params


def test_zero2_steps_split_groups_as_one(tmp_path):
    import json
    import os

    extensions = tmp_path / "torch_extensions"  # where DeepSpeed would build its ops: none is built
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)})  # fmt: skip
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert run.returncode == 0 and line, run.stderr[-3000:]
    whole, split = json.loads(line[7:]).values()
    assert (whole["groups"], split["groups"], split["added"]) == (1, 3, 2)
    assert "OptimState8bit" in whole["states"] and "OptimState8bit" in split["states"]
    assert split["losses"] == whole["losses"] and whole["losses"][-1] < whole["losses"][0]
    for a, b in zip(whole["weights"], split["weights"], strict=True):
        assert max(abs(u - v) for u, v in zip(a, b, strict=True)) < 1e-5
    assert not extensions.exists()
