"""The tiny model kit: a local tokenizer, the Qwen3 keep-thinking chat template and a tiny Qwen3."""
