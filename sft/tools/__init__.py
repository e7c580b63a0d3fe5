"""Commands around training: merging a LoRA adapter (`merge`), evaluation with lm-eval (`evaluation`), the run report
(`report`), the demo's model, tokenizer and data (`demo`).

May import anything in sft; nothing in sft imports them but the command table (`sft.cli`) and the entry point, which
writes the report at the end of a run.
"""
