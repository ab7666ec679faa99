"""Text: tokenizer, chat templates, incremental detokenizer, stop strings, the streaming Qwen
output parser (reasoning / content / tool calls) and output constraints (llguidance)."""
