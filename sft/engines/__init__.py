"""Training engines: what sft needs from the library that shards and steps the model (DeepSpeed today)."""
