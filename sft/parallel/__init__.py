"""Processes and how a run is split over them (the sizes themselves are `sft.core.dims`): the process group and
leaving it (`distributed`), several nodes (`nodes`), starting worker processes (`launch`), sequence parallelism
(`sequence`).

May import: `sft.errors`, `sft.core` (steps per epoch, for a sequence-parallel resume), `sft.model` (attention
boundaries, architectures, FP8's token multiple). `launch` and `nodes` import no torch at module level: the
launcher's agent reads them without paying for torch's imports.
"""
