"""The training run once planned: the trainer (TRL's SFTTrainer with sft's components), checkpoints and resume
(`checkpoint`), the fail-safe for non-finite steps and out-of-memory errors (`failsafe`), metrics (`metrics`) and
what the console shows (`logs`).

May import everything below it: `sft.plan`, `sft.model`, `sft.parallel`, `sft.data`, `sft.engines` (through the
engine interface). Nothing imports the trainer but the entry point (`sft.train`) and the tools.
"""
