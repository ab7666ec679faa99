"""Offline tools: `convert` (Hugging Face checkpoints -> `.infernix`; `hf_checkpoint` reads
their config and safetensors), `make_tiny` (tiny random-weight models for tests and demos),
`quality/` (measurements such as perplexity), `chat_templates/` (our maintained Jinja templates)."""
