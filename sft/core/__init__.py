"""The bottom layer: what every other folder reads and nothing here decides. The parallel sizes (`dims`:
`ParallelDims`, the one owner of world, data-parallel, sequence- and expert-parallel sizes, and which parameters
expert parallelism splits), the batch arithmetic (`batch`: global batch, accumulation, steps per epoch), the decided
run (`run`: `RunPlan`, `MemoryDecision`, `Resume`), what an engine declares about itself and how it splits the
training state (`engine`: `Traits`, `Sharding`), the out-of-memory retry's protocol and the exit codes (`retry`),
the recipe file read before anything heavy is imported (`recipe`), how a process ends (`leave`), the files of an
output directory that several parts read (`outputs`), the subcommands' argument parsing (`flags`) and what the
console shows (`logs`).

May import: `sft.errors` only.
"""
