"""Offline tools: `convert` (Hugging Face checkpoints -> `.infernix`), `make_tiny` (tiny
random-weight models for tests and demos), `quality/` (measurements such as perplexity),
`chat_templates/` (our maintained Jinja templates)."""
