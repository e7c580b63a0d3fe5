"""What sft knows about a model and the changes it makes to one: the families (`families`, one record each, and
`architectures`, what a config's model is and the tables viewed from the records), the attention
backends (`attention`), the shapes the plan reads (`shapes`) and FLOPs (`flops`), building the model (`build`), and
the model changes applied as converters in one declared order (`converters`: sft's experts, FP8, compiled layers,
tiled MLP, kept attention outputs; QLoRA's weights in `quantization`).

May import: `sft.errors`, `sft.core` (the RunPlan type), `sft.config` (the argument classes), `sft.engines` (through
the engine interface). Not the data or the trainer.
"""
