"""Infernix runtime: everything that runs at serve time, torch-free (numpy + cuda-python).

Subpackages, top to bottom (arrows point down only): `text` (tokenizer, templates, parsers),
`engine` (requests, scheduler, sampler, engine loop), `model` (config, NumPy reference runner,
CUDA runner), `artifact` (`.infernix` reader/writer), `cuda` (the only code touching
`cuda.bindings`). `cli` is the `infernix` command.
"""
