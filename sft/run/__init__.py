"""The training run once planned: the trainer (TRL's SFTTrainer with sft's components), checkpoints and resume
(`checkpoint`), the fail-safe for non-finite steps and out-of-memory errors (`failsafe`) and metrics (`metrics`).

May import: `sft.errors`, `sft.core` (the RunPlan, steps per epoch), `sft.model`, `sft.parallel` (sequence
parallelism's trainer hooks). Nothing imports the trainer but the entry point (`sft.train`) and the tools.
"""
