"""Commands around training: merging a LoRA adapter (`merge`), evaluation with lm-eval (`evaluation`), the run report
(`report`, the command: `sft.run.report` writes it), the demo's model, tokenizer and data (`demo`).

May import anything in sft; nothing in sft imports them but the command table (`sft.cli`).
"""
