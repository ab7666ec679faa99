"""Running requests through an `Engine` on a GPU runner (no tests here; GPU test files import it)."""

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
