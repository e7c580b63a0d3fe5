"""The training data: loading and checking every record (`load`), and its figures once tokenised (`stats`, the
`sft data` command); image+text records checked, encoded and packed exactly (`vision`).

May import: `sft.errors`, `sft.core` (steps per epoch, the console's logging), `sft.config`,
`sft.parallel.distributed` (an error on one rank stops every rank), `sft.model.build` (the tokenizer, for `sft
data`), `sft.model.architectures` (which families are vision-language ones).
"""
