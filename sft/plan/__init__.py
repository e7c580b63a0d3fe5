"""Deciding a run before any expensive work: the batch arithmetic (`batch`), the memory plan (`memory`, and its
command `cli`), the decision itself (`preflight`) and what it returns, the frozen `RunPlan` (`run`).

May import: `sft.errors`, `sft.config`, `sft.model` (what a model is), `sft.parallel.dims`, `sft.engines` (through
the engine interface), `sft.run.failsafe` (the retry it plans for). Nothing here builds a model or trains.
"""
