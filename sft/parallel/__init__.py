"""Processes and how a run is split over them: the parallel sizes (`dims`), the process group and leaving it
(`distributed`), several nodes (`nodes`), starting worker processes (`launch`), sequence parallelism (`sequence`).

May import: `sft.errors`, `sft.model` (attention boundaries, architectures, FP8's token multiple), `sft.plan.batch`
(steps per epoch, for a sequence-parallel resume). `launch` and `nodes` import no torch at
module level: the launcher's agent reads them without paying for torch's imports.
"""
