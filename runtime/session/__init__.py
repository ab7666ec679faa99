"""A ready model session: the one place that turns settings into a loaded model behind a
running engine, shared by `infernix` (the CLI) and `infernix-serve`.

    session = ModelSession.open(settings)            # CliSettings or ServeSettings
    prompt = session.render(messages, tools=tools)   # -> RenderedPrompt (ids, thinking open?)
    request = session.build_request(prompt, max_new_tokens=..., ...)
    stream = session.engine.submit(request)          # EngineOutput increments
    session.close()

`open` loads the artifact, picks the runner (`--device cpu`: the NumPy reference; `cuda`: the
CUDA runner; `auto`: cuda when a CUDA driver reports a GPU, else cpu), loads the tokenizer and the chat template (the artifact's or `--chat-template`),
sizes the KV pool (`--kv-capacity`, by default `--max-context` times the lanes) and starts the
engine. `--demo` without a model path generates a tiny real-vocabulary model once (cached under
$INFERNIX_CACHE or ~/.cache/infernix) and runs it on the CPU.

Modules, one job each:
- `model_session`: `ModelSession` and `RenderedPrompt` (opening, prompts, request building);
- `engine_settings`: the options as the engine's and the runner's settings (KV pool, prefix
  cache, speculative decoding, state slots, vision), refusing combinations that cannot work;
- `backend`: the device (`--device`) and the runner built for it;
- `model_files`: the model file named by the settings, or the cached `--demo` model.

The names the front ends, tools and tests use are importable from here.
"""

from runtime.session.backend import CUDA_RUNNER_MODULE, choose_device, gpu_present
from runtime.session.engine_settings import (cache_fingerprint, prefix_cache_settings,
                                             speculative_settings, vision_settings)
from runtime.session.model_files import DEMO_SEED, cache_dir, demo_model_path
from runtime.session.model_session import (THINKING_CLOSE_TEXT, TURN_SNAPSHOTS, ModelSession,
                                           RenderedPrompt, turn_starts, word_kinds_table)

__all__ = ["CUDA_RUNNER_MODULE", "DEMO_SEED", "THINKING_CLOSE_TEXT", "TURN_SNAPSHOTS",
           "ModelSession", "RenderedPrompt", "cache_dir", "cache_fingerprint", "choose_device",
           "demo_model_path", "gpu_present", "prefix_cache_settings", "speculative_settings",
           "turn_starts", "vision_settings", "word_kinds_table"]
