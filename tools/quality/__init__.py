"""Offline quality measurements of a model as the engine runs it: `perplexity` (causal
perplexity of a text with sliding windows, on the NumPy reference or the CUDA runner)."""
