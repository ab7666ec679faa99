"""Running requests through an `Engine` on a GPU runner, and the small runners such runs use (no
tests here; GPU test files import it)."""

from __future__ import annotations


def run_engine(runner, requests, *, stagger=0, **config):
    """(token ids of each request, the engine's counters) through one engine built with
    `EngineConfig(**config)`; with `stagger`, request i is submitted once request i - 1 has
    produced `stagger` tokens (sequences join and leave a running decode batch)."""
    from runtime.engine.engine_loop import Engine, EngineConfig

    engine = Engine(runner, EngineConfig(**config), on_thread_start=runner.device.make_current).start()
    try:
        streams, tokens = [], []

        def pull(i):
            tokens[i].extend(streams[i].get(timeout=120).token_ids)

        for request in requests:
            if stagger and streams:
                while len(tokens[-1]) < stagger and not streams[-1].done:
                    pull(len(streams) - 1)
            streams.append(engine.submit(request))
            tokens.append([])
        for i, stream in enumerate(streams):
            while not stream.done:
                pull(i)
        return tokens, dict(engine.counters)
    finally:
        engine.shutdown()


def small_runner(kind, tiny_path, device, library, **shape):
    """A `CudaRunner` for engine-level GPU tests: kind "tiny" is the tiny dense artifact at
    `tiny_path`, "27b-4-layers" the first 4 layers of the Qwen3.6-27B shape with synthetic
    weights (seed 9: near-ties everywhere); `shape` holds the runner's sizes and options."""
    from runtime.model.gpu.runner import CudaRunner

    if kind == "tiny":
        return CudaRunner.from_artifact(tiny_path, device=device, library=library, **shape)
    from bench.decode import QWEN36_27B
    from runtime.model.config import ModelConfig

    config = dict(QWEN36_27B, num_hidden_layers=4, layer_types=QWEN36_27B["layer_types"][:4])
    return CudaRunner.synthetic(ModelConfig.from_dict(config), 9, device=device, library=library, **shape)
