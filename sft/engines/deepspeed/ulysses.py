"""DeepSpeed's ALST pieces that sft runs: accelerate's Ulysses configuration (`parallelism_config`), Ulysses'
data-loader adapter (each sequence-parallel rank gets its slice of every row), made to gather rows of different
lengths on any backend, and the tiled MLP's autograd function."""

from __future__ import annotations

import torch

from sft.errors import ConfigError


def tiled_mlp():
    """DeepSpeed ALST's `TiledMLP` autograd function (`sft.model.build.tiling` applies it to each decoder layer's
    MLP)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    return TiledMLP


def uneven_rows_adapter(adapter):
    """DeepSpeed's `UlyssesSPDataLoaderAdapter` (as transformers' Trainer made it), gathering the sp ranks' rows of
    different lengths on any backend. DeepSpeed's `refill` all-gathers each rank's batch with rank-sized receive
    buffers, which NCCL accepts and gloo refuses ("invalid tensor size"); here each rank's tensors are padded to the
    longest row of the group for the gather and cut back to their own length after it. Everything else is
    DeepSpeed's: each batch is split into sp contiguous slices, `labels` become pre-shifted `shift_labels`."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    class UnevenRowsAdapter(UlyssesSPDataLoaderAdapter):
        def skip(self, micro_batches: int) -> None:
            """Drop the first `micro_batches` (a resume): whole batches of the wrapped loader are skipped without
            being gathered, the remainder out of the next refill. accelerate's `skip_first_batches`, which
            transformers uses, rebuilds a plain DataLoader from a loader's sampler and so cannot skip through an
            adapter."""
            whole, rest = divmod(micro_batches, self.sp_world_size)
            for _ in range(whole):
                next(self.iter)
            for _ in range(rest):
                next(self)

        def refill(self):
            import torch.distributed as dist

            try:
                batch = next(self.iter)
            except StopIteration:
                self.iter = iter(self.dl)
                raise
            if "position_ids" not in batch:
                raise ConfigError("sequence parallelism needs `position_ids` in every batch (padding-free batches).")
            length = torch.tensor([batch["input_ids"].shape[1]], device=self.device)
            lengths = [torch.zeros_like(length) for _ in range(self.sp_world_size)]
            dist.all_gather(lengths, length, group=self.sp_group)
            lengths = [int(x) for x in lengths]
            longest = max(lengths)
            rows: list[dict] = [{} for _ in range(self.sp_world_size)]
            for key, value in batch.items():
                if torch.is_tensor(value):
                    value = torch.nn.functional.pad(value.to(self.device), (0, longest - value.shape[1]))
                    gathered = [torch.empty_like(value) for _ in range(self.sp_world_size)]
                    dist.all_gather(gathered, value, group=self.sp_group)
                    gathered = [t[:, :n] for t, n in zip(gathered, lengths, strict=True)]
                else:
                    gathered = [None] * self.sp_world_size
                    dist.all_gather_object(gathered, value, group=self.sp_group)
                for row, item in zip(rows, gathered, strict=True):
                    row[key] = item
            for row in rows:
                seq = row["input_ids"].shape[1]
                if seq % self.sp_world_size:
                    raise ConfigError(f"a row of {seq} tokens is not a multiple of sequence_parallel_size.")
                chunk = seq // self.sp_world_size
                labels = torch.nn.functional.pad(row.pop("labels"), (0, 1), value=-100)
                row["shift_labels"] = labels[..., 1:].contiguous()
                part = slice(chunk * self.sp_rank, chunk * (self.sp_rank + 1))
                self.micro_batches.append({k: v[:, part].cpu() if torch.is_tensor(v) else v for k, v in row.items()})

    return UnevenRowsAdapter(adapter.dl, adapter.sp_rank, adapter.sp_group, adapter.sp_world_size, adapter.device)


def parallelism_config(dims, attn_implementation: str):
    """accelerate's ParallelismConfig for `dims` (None without SP): Ulysses on DeepSpeed, variable row lengths."""
    if dims.sp == 1:
        return None
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True)
    # accelerate validates the backend against a fixed list (flash_attention_2/3, sdpa) that misses transformers'
    # registered backends; DeepSpeed itself checks the name against transformers' registry when it wraps it.
    handler.sp_attn_implementation = attn_implementation
    return ParallelismConfig(sp_backend="deepspeed", sp_size=dims.sp, dp_replicate_size=dims.dp, sp_handler=handler)
