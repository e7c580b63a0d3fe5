"""Where a training run's GPU memory is at its peak: `sft/train.py` with CUDA's allocation history recorded.

    torchrun --nproc_per_node 1 benchmarks/memory_trace.py --config run.yaml      (MEMORY_TRACE_OUT=trace.json)

Recording starts when training begins (after the model and DeepSpeed's engine are built: what they hold is the
`held_at_start` line) and stops when it ends. The allocations and frees in between are replayed to find the moment
of the peak; the blocks alive then are summed by where they were allocated (the innermost Python frame outside
torch's own modules, and the frame that called into it), largest first, and written to MEMORY_TRACE_OUT as JSON.
The replayed peak equals `torch.cuda.max_memory_allocated` (`peak_allocated` beside it) when the history held every
event (`max_entries`).
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_ENTRIES = 4_000_000
# torch's own frames say nothing about which tensor it is, except the checkpoint's recomputation and DeepSpeed's
OWN = (
    "/torch/nn/modules/", "/torch/autograd/", "/torch/_tensor.py", "/torch/nn/functional.py", "/torch/_ops.py",
    "/torch/utils/_contextlib.py", "/torch/_compile.py", "/torch/_dynamo/", "/torch/amp/", "/torch/_library/",
)  # fmt: skip


def where(frames: list[dict]) -> str:
    """`file:line function <- caller file:line function`, innermost frame first, torch's plumbing skipped."""
    kept = [f for f in frames if f.get("filename", "").endswith(".py") and not any(o in f["filename"] for o in OWN)]
    parts = []
    for f in kept[:2]:
        name = f["filename"]
        for root in ("site-packages/", "dist-packages/", str(ROOT) + "/"):
            name = name.split(root, 1)[-1]
        parts.append(f"{name}:{f['line']} {f['name']}")
    return " <- ".join(parts) or "(no Python frame)"


def peak_blocks(trace: list[dict]) -> tuple[int, int, dict[int, dict]]:
    """(the peak of the replayed allocations above the start, the index of the event that reached it, the blocks
    alive then: address -> event)."""
    live: dict[int, dict] = {}
    total = top = top_at = 0
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > top:
                top, top_at = total, i
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    live, total = {}, 0
    for event in trace[: top_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return top, top_at, live


def summarise(snapshot: dict, held: int, peak_allocated: int) -> dict:
    import torch

    device = torch.cuda.current_device()
    trace = snapshot["device_traces"][device]
    top, top_at, live = peak_blocks(trace)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        g = groups[where(event.get("frames", []))]
        g[0] += event["size"]
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    largest = sorted(live.values(), key=lambda e: -e["size"])[:30]
    gib = 2**30
    return {
        "held_at_start_gib": held / gib,
        "replayed_peak_gib": (held + top) / gib,
        "peak_allocated_gib": peak_allocated / gib,
        "events": len(trace),
        "peak_event": top_at,
        "truncated": len(trace) >= MAX_ENTRIES,
        "groups": [{"gib": s / gib, "blocks": n, "where": k} for k, (s, n) in rows[:40]],
        "largest": [{"gib": e["size"] / gib, "where": where(e.get("frames", []))} for e in largest],
    }


def main() -> None:
    import torch

    from sft import metrics

    out = Path(os.environ["MEMORY_TRACE_OUT"])
    state = {}
    begin = metrics.Throughput.on_train_begin

    def on_train_begin(self, *args, **kwargs):
        result = begin(self, *args, **kwargs)
        torch.cuda.synchronize()
        state["held"] = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        return result

    def on_train_end(self, *args, **kwargs):
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        summary = summarise(snapshot, state["held"], torch.cuda.max_memory_allocated())
        out.write_text(json.dumps(summary, indent=1))

    metrics.Throughput.on_train_begin = on_train_begin
    metrics.Throughput.on_train_end = on_train_end
    from sft.train import run

    sys.argv[0] = str(ROOT / "sft" / "train.py")
    run()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
