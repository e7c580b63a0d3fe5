"""Where sequence-parallel gradients go wrong on GPUs: each piece of the sp=2 path against sp=1, per parameter.

    python -m benchmarks.sp_gradients --out $OUT                  # both parts, 2 GPUs (or 2 CPU processes)
    python -m benchmarks.sp_gradients --parts components --out $OUT

- `components` (one torchrun of 2 processes, no Trainer, no DeepSpeed engine): a Llama-3.2-1B-shaped model of few
  layers, one packed row of SFT-like samples. The reference is the whole row on one rank; the sp=2 side is the same
  weights behind DeepSpeed's `UlyssesSPAttentionHF` (all-to-all around `sft_varlen`), each rank its half of the row,
  gradients summed over the ranks. Variants: the attention kernel (PyTorch's varlen FlashAttention-2, or the exact
  per-sample sdpa), bf16 or fp32 weights, the loss summed by hand or transformers' Ulysses loss (a differentiable
  all-gather). Per variant: loss, gradient norm, and each parameter's relative gradient error.
- `trainer`: the real CLI (as `benchmarks.long_context` equality: 1B shape, 16k rows, ZeRO-2, bf16), 1 step, with
  every parameter's full gradient (`deepspeed.utils.safe_get_full_grad`) taken just before DeepSpeed's first
  optimizer step, for the `--cases` (processes, ZeRO stage, overlap_comm; the first is the reference), by default
  sp=1 on 1 GPU against sp=2 on 2 GPUs with DeepSpeed's overlap_comm on and off. (sp=2 with overlap_comm on under
  ZeRO-1/2 is refused by sft since this measurement; a case asking for it fails with that error.)
Results: `sp_gradients.{json,md}` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.common import LLAMA_SHAPES, ROOT, environment, run, torchrun, write_results

# Loaded by the trainer runs through PYTHONPATH: dumps the gradients at DeepSpeed's first step.
SITECUSTOMIZE = """
import json, os
if os.environ.get("SFT_DIAG_GRADS"):
    import deepspeed.runtime.engine as _engine
    _step = _engine.DeepSpeedEngine.step
    def step(self, *a, **k):
        if not getattr(self, "_diag_done", False):
            self._diag_done = True
            from deepspeed.utils import safe_get_full_grad
            norms = {}
            for name, p in self.module.named_parameters():
                g = safe_get_full_grad(p)
                norms[name] = None if g is None else float(g.float().norm())
            torch = __import__("torch")
            if torch.distributed.get_rank() == 0:
                with open(os.environ["SFT_DIAG_GRADS"], "w") as f:
                    json.dump({"norms": norms}, f)
        return _step(self, *a, **k)
    _engine.DeepSpeedEngine.step = step
"""


def packed_row(length: int, vocab: int, sp: int, seed: int = 0):
    """One packed row of SFT-like samples (the last one cut), padded to a multiple of sp: ids, positions, labels."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < length:
        n = int(min(max(rng.lognormal(np.log(300), 1.0), 16), length - total))
        lengths.append(n)
        total += n
    ids = torch.tensor(rng.integers(10, vocab, size=length), dtype=torch.long)
    positions = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    starts = torch.tensor([0, *np.cumsum(lengths)[:-1].tolist()])
    labels[starts] = -100  # TRL's padding-free collator: no target across a sample boundary
    pad = -length % sp
    ids = torch.nn.functional.pad(ids, (0, pad), value=1)
    positions = torch.nn.functional.pad(positions, (0, pad), value=0)
    labels = torch.nn.functional.pad(labels, (0, pad), value=-100)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[1:]
    return ids[None], positions[None], shift[None], lengths


def components(args) -> None:
    """Run under torchrun (2 processes): the variants, one JSON line per variant on rank 0."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    import sft.model.attention as attention

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, sp = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    kernel = attention._varlen_attn
    attention.register_varlen()
    AttentionInterface.register("sft_varlen_ref", attention.varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sft_varlen_ref", flash_attention_mask)
    shape = {k: v for k, v in LLAMA_SHAPES["llama-1b"].items() if k not in ("architectures", "model_type", "dtype")}
    shape.update(num_hidden_layers=args.layers, vocab_size=args.vocab)
    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    ref = LlamaForCausalLM._from_config(config, attn_implementation="sft_varlen_ref", dtype=torch.float32)
    par = LlamaForCausalLM._from_config(config, attn_implementation=attention.VARLEN, dtype=torch.float32)
    par.load_state_dict(ref.state_dict())
    UlyssesSPAttentionHF.register_with_transformers(par, attention.VARLEN, sp, 1)
    group = None  # the whole world is the sp group here
    ids, positions, shift, lengths = packed_row(args.length, args.vocab, sp)
    targets = int((shift != -100).sum())
    chunk = ids.shape[1] // sp
    part = slice(rank * chunk, (rank + 1) * chunk)
    kernels = ["varlen", "per_sample"] if cuda else ["per_sample"]
    for kernel_name in kernels:
        attention._varlen_attn = kernel if kernel_name == "varlen" else (lambda: None)
        for dtype in (torch.bfloat16, torch.float32):
            for loss_kind in ("sum", "transformers"):
                ref.to(device, dtype)
                par.to(device, dtype)
                ref.zero_grad(set_to_none=True)
                par.zero_grad(set_to_none=True)
                logits = ref(input_ids=ids.to(device), position_ids=positions.to(device)).logits.float()
                loss_ref = (
                    torch.nn.functional.cross_entropy(
                        logits.view(-1, logits.shape[-1]), shift.view(-1).to(device), reduction="sum"
                    )
                    / targets
                )
                loss_ref.backward()
                del logits
                local_shift = shift[:, part].to(device)
                logits = par(input_ids=ids[:, part].to(device), position_ids=positions[:, part].to(device)).logits
                ce = torch.nn.functional.cross_entropy(
                    logits.float().view(-1, logits.shape[-1]), local_shift.view(-1), reduction="sum"
                )
                if loss_kind == "sum":
                    loss_local = ce / targets
                    loss_local.backward()
                    loss_par = loss_local.detach().clone()
                    dist.all_reduce(loss_par)
                    factor = 1.0
                else:  # transformers' deepspeed_sp_compute_loss
                    good = (local_shift != -100).sum()
                    mean = ce / good.clamp(min=1)
                    losses = torch.stack(torch.distributed.nn.functional.all_gather(mean, group=group))
                    goods = torch.stack(torch.distributed.nn.functional.all_gather(good, group=group))
                    loss_par = (losses * goods).sum() / goods.sum()
                    loss_par.backward()
                    factor = 1.0 / sp  # the gather's backward sums over the ranks
                del logits
                errors, ref_sq, par_sq = {}, 0.0, 0.0
                for (name, p_ref), (_, p_par) in zip(ref.named_parameters(), par.named_parameters(), strict=True):
                    g = p_par.grad.float() if p_par.grad is not None else torch.zeros_like(p_ref, dtype=torch.float32)
                    dist.all_reduce(g)
                    g = g * factor
                    r = p_ref.grad.float()
                    ref_sq += float(r.norm()) ** 2
                    par_sq += float(g.norm()) ** 2
                    errors[name] = float((g - r).norm() / r.norm().clamp(min=1e-30))
                worst = sorted(errors.items(), key=lambda kv: -kv[1])[:5]
                if rank == 0:
                    print("RESULT " + json.dumps({
                        "kernel": kernel_name, "dtype": str(dtype).split(".")[-1], "loss": loss_kind,
                        "loss_ref": float(loss_ref), "loss_sp": float(loss_par),
                        "grad_norm_ref": ref_sq ** 0.5, "grad_norm_sp": par_sq ** 0.5,
                        "median_rel_error": sorted(errors.values())[len(errors) // 2], "worst": worst,
                        "samples": len(lengths), "row": ids.shape[1],
                    }), flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def trainer_runs(work: Path, specs: list[str]) -> dict:
    from benchmarks.long_context import model_dir, sft_like_data, train

    diag = work / "diag"
    diag.mkdir(parents=True, exist_ok=True)
    (diag / "sitecustomize.py").write_text(SITECUSTOMIZE)
    model = model_dir(work / "llama-1b", LLAMA_SHAPES["llama-1b"])
    data = sft_like_data(work / "sft_like.jsonl", 4000, LLAMA_SHAPES["llama-1b"]["vocab_size"])
    common = ["--max_length", "16384", "--per_device_train_batch_size", "1", "--global_batch_size", "2",
              "--gradient_accumulation_steps", "1", "--max_steps", "1", "--use_liger_kernel", "false"]  # fmt: skip
    cases = {}
    for spec in specs:  # name:processes:zero stage:overlap_comm (auto | true | false)
        name, nproc, stage, overlap = spec.split(":")
        config = json.loads((ROOT / "ds_configs" / f"zero{stage}.json").read_text())
        config["zero_optimization"]["overlap_comm"] = {"auto": "auto", "true": True, "false": False}[overlap]
        (work / f"{name}.json").write_text(json.dumps(config))
        sp = ["--sequence_parallel_size", "2"] if int(nproc) == 2 else []
        cases[name] = (int(nproc), ["--deepspeed", str(work / f"{name}.json"), *sp])
    results = {}
    path = os.environ.get("PYTHONPATH", "")
    for name, (nproc, extra) in cases.items():
        dump = work / f"{name}_grads.json"
        os.environ.update({"SFT_DIAG_GRADS": str(dump), "PYTHONPATH": f"{diag}:{path}"})
        r = train(work, name, nproc, model, data, [*common, *extra])
        os.environ.pop("SFT_DIAG_GRADS", None)
        os.environ["PYTHONPATH"] = path
        norms = json.loads(dump.read_text())["norms"] if dump.exists() else {}
        results[name] = {"rc": r["rc"], "loss": [x["loss"] for x in r["records"]],
                         "grad_norm": [x["grad_norm"] for x in r["records"]], "norms": norms}  # fmt: skip
    base = results[next(iter(results))]["norms"]  # the first case is the reference
    for res in list(results.values())[1:]:
        if not base or not res["norms"]:
            continue
        ratios = {k: res["norms"][k] / base[k] for k in base if base[k] and res["norms"].get(k) is not None}
        res["norm_ratio_vs_sp1"] = dict(sorted(ratios.items(), key=lambda kv: -abs(kv[1] - 1))[:12])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parts", default="components,trainer")
    parser.add_argument("--work", type=Path, default=Path("/tmp/sp_gradients"))
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--cases",
        default="sp1:1:2:auto,sp2:2:2:auto,z3_sp1:1:3:true,z3_sp2:2:3:true,z3_sp2_no_overlap:2:3:false",
        help="trainer runs, name:processes:zero stage:overlap_comm; the first is the reference",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        components(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment()}
    if "components" in args.parts:
        log = args.work / "components.log"
        log.unlink(missing_ok=True)
        cmd = [*torchrun(2), "-m", "benchmarks.sp_gradients", "--worker", "--length", str(args.length),
               "--layers", str(args.layers), "--vocab", str(args.vocab)]  # fmt: skip
        rc, seconds = run(cmd, log)
        rows = [json.loads(line[7:]) for line in log.read_text().splitlines() if line.startswith("RESULT ")]
        result["components"] = {"rc": rc, "seconds": round(seconds, 1), "variants": rows}
        if rc:
            print(log.read_text()[-4000:], file=sys.stderr)
    if "trainer" in args.parts:
        result["trainer"] = trainer_runs(args.work, args.cases.split(","))
    lines = ["# Sequence-parallel gradients: sp=2 against sp=1, piece by piece", "", result["environment"]["device"]]
    for row in result.get("components", {}).get("variants", []):
        lines.append(
            f"- components {row['kernel']} {row['dtype']} loss={row['loss']}: loss {row['loss_ref']:.6f} / "
            f"{row['loss_sp']:.6f}, grad norm {row['grad_norm_ref']:.4f} / {row['grad_norm_sp']:.4f}, median rel "
            f"error {row['median_rel_error']:.2e}, worst {row['worst'][:2]}"
        )
    for name, res in result.get("trainer", {}).items():
        lines.append(f"- trainer {name}: rc {res['rc']}, loss {res['loss']}, grad norm {res['grad_norm']}")
        if res.get("norm_ratio_vs_sp1"):
            lines.append(f"  - worst per-parameter norm ratios vs the first case: {res['norm_ratio_vs_sp1']}")
    print("\n".join(lines))
    if args.out:
        write_results(args.out, "sp_gradients", result, "\n".join(lines))


if __name__ == "__main__":
    main()
