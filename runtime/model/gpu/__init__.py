"""The CUDA model runner (`runner.CudaRunner`), one module per job.

- `runner`: `CudaRunner`, the `ModelRunner` protocol (checks, slot mapping, the step contract);
- `storage`: the device arenas (weights, KV pages, state slots with spares and pad, workspace),
  the metadata and sampling block layouts, the pinned host buffers; `StateSlots`;
- `weights`: where each weight lives (`WeightLayout`), its upload or synthetic fill, RoPE tables;
- `kernels`: which compiled variant runs each part (`KernelChoice`);
- `layers`: the forward pass as bound launches, one builder per layer kind, `linear(weight)`;
- `step`: metadata upload, plans, batch buckets, graph capture and replay, look-ahead;
- `sampling`: device sampling of logits rows.
"""
