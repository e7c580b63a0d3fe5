"""GPU memory an optimizer step adds beyond its states, per element of the parameters it steps (issue #53).

    python -m benchmarks.optimizer_step_memory --out $OUT          # one GPU; flat fp32 tensors as ZeRO-2 hands over

ZeRO-2 gives the optimizer its partition as one flat fp32 tensor (one per parameter group), so an optimizer that
builds fp32 temporaries of its states at the step (torchao's 8-bit AdamW dequantises both moments, updates, then
quantises them back) holds them for the whole partition at once. For each optimizer and size: memory held after the
first step (the states) and the peak during the second step above what was held before it, per element.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

OPTIMIZERS = {
    "adamw_torch_fused": lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),
    "adamw_torch_8bit": lambda params: __import__("torchao.optim", fromlist=["AdamW8bit"]).AdamW8bit(params, lr=1e-4),
}


def measure(name: str, elements: int) -> dict:
    torch.cuda.empty_cache()
    param = torch.nn.Parameter(torch.zeros(elements, dtype=torch.float32, device="cuda"))
    param.grad = torch.randn_like(param) * 1e-3
    optimizer = OPTIMIZERS[name]([param])
    optimizer.step()  # builds the states (and compiles)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    states = held - 2 * 4 * elements  # less the parameter and its gradient
    result = {"optimizer": name, "elements": elements, "states_bytes_per_element": states / elements,
              "step_transient_bytes_per_element": (peak - held) / elements}  # fmt: skip
    del optimizer, param
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--elements", type=float, nargs="*", default=[2.5e8, 1e9, 2e9])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [measure(name, int(n)) for n in args.elements for name in OPTIMIZERS]
    for r in results:
        print(f"{r['optimizer']:<20} {r['elements']:>13,} elements: states {r['states_bytes_per_element']:.3f} B, "
              f"step transient {r['step_transient_bytes_per_element']:.3f} B per element", flush=True)  # fmt: skip
    record = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    (args.out / "optimizer_step_memory.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
