"""Deciding a run before any expensive work: the memory plan (`memory`, its levers `levers`, and its command `cli`),
the search over settings (`search`), the families' kernels (`kernels`), the speed model (`speed`), the decision itself
(`preflight`), which returns the frozen `sft.core.run.RunPlan` (the batch arithmetic is `sft.core.batch`), and a run's
training arguments with its engine entered (`arguments`).

May import: `sft.errors`, `sft.core`, `sft.config` (the parsed fields), `sft.model` (what a model is), `sft.engines`
(through the engine interface), `sft.data.vision` (an image+text run's packing), `sft.parallel.sequence` (Ulysses'
checks and sizes). Nothing here builds a model or trains.
"""
