"""The training run once planned: the trainer (TRL's SFTTrainer with sft's components), checkpoints and resume
(`checkpoint`), the fail-safe for non-finite steps and out-of-memory errors (`failsafe`), metrics (`metrics`), the
run's report (`report`: plots and a page, written at its end and by `sft report`) and the one-GPU optimizer step
(`optimizer`, its Triton kernel `adamw8bit_kernel`).

May import: `sft.errors`, `sft.core` (the RunPlan, steps per epoch), `sft.model`, `sft.parallel` (sequence
parallelism's trainer hooks), `sft.plan.memory` (the fused 8-bit step's limits, which the memory plan counts),
`sft.plan.levers` (the memory levers, named in the out-of-memory advice).
Nothing imports the trainer but the entry point (`sft.train`) and the tools.
"""
