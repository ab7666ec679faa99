"""A ready model session: the one place that turns settings into a loaded model behind a
running engine, shared by `infernix` (the CLI) and `infernix-serve`.

    session = ModelSession.open(settings)            # CliSettings or ServeSettings
    prompt = session.render(messages, tools=tools)   # -> RenderedPrompt (ids, thinking open?)
    request = session.build_request(prompt, max_new_tokens=..., ...)
    stream = session.engine.submit(request)          # EngineOutput increments
    session.close()

`open` loads the artifact, picks the runner (`--device cpu`: the NumPy reference; `cuda`: the
CUDA runner, an error until it exists; `auto`: cuda when a GPU and the CUDA runner are there,
else cpu), loads the tokenizer and the chat template (the artifact's or `--chat-template`),
sizes the KV pool (`--kv-capacity`, by default `--max-context` times the lanes) and starts the
engine. `--demo` without a model path generates a tiny real-vocabulary model once (cached under
$INFERNIX_CACHE or ~/.cache/infernix) and runs it on the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from runtime.config import ConfigError
from runtime.engine.api import EngineRequest, SamplingParams, ThinkingControl
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.kv_pages import pages_for
from runtime.engine.presets import SamplingOverrides, model_presets, resolve_sampling
from runtime.engine.speculative import SlotLayout, SpeculativeConfig
from runtime.engine.thinking import WORD_CONTINUES, WORD_SEPARATOR, WORD_STARTS
from runtime.log import Progress, get_logger
from runtime.media.sources import SourceLimits
from runtime.model.config import ModelConfig
from runtime.model.runner import PAGE_SIZE
from runtime.text.parser import prompt_ends_in_reasoning

# Qwen's canonical early-close guidance and `</think>`, inserted when the thinking budget runs
# out. The blank line after `</think>` is left to the model (and to a constraint's separator).
THINKING_CLOSE_TEXT = ("\n\nConsidering the limited time by the user, I have to give the "
                       "solution based on the thinking directly now.\n</think>")
DEMO_SEED = 0
CUDA_RUNNER_MODULE = "runtime.model.gpu.runner"


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat rendered to token ids.

    thinking: the prompt ends inside an open think block (thinking mode: the thinking presets
        apply and the thinking controls are armed).
    """

    ids: tuple[int, ...]
    thinking: bool
    media: tuple = ()      # `MediaSpan`s of the prompt's images (pads already expanded)


def cache_dir() -> Path:
    """$INFERNIX_CACHE, or ~/.cache/infernix."""
    root = os.environ.get("INFERNIX_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "infernix"


def demo_model_path(logger=None) -> Path:
    """The cached tiny demo model (real Qwen vocabulary, random weights); built on first use,
    which takes seconds: `logger` (when given) says so, with the build's phases."""
    path = cache_dir() / f"demo-tiny-dense-real-seed{DEMO_SEED}.infernix"
    if path.exists():
        return path
    from tools.make_tiny import make_tiny    # build-time tool; only the demo needs it

    def phase(text: str) -> None:
        if logger is not None:
            logger.info("demo: %s", text)

    phase(f"first run: building the demo model once (about 10 s), cached as {path}")
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.stem + f".partial-{os.getpid()}.infernix")
    hf_dir = path.parent / f"{path.stem}.partial-{os.getpid()}-hf"
    try:
        make_tiny(partial, family="dense", vocab="real", seed=DEMO_SEED, hf_dir=hf_dir,
                  log=None, on_phase=phase)
        partial.replace(path)                # atomic: concurrent first runs stay consistent
        phase(f"demo model built ({time.perf_counter() - started:.1f} s)")
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
        partial.unlink(missing_ok=True)
    return path


def _directory_given(path: Path) -> str:
    """What to say when the model path is a directory (a model is one `.infernix` file)."""
    if (path / "config.json").is_file():
        return (f"model {str(path)!r} is a Hugging Face checkpoint directory; convert it "
                f"first: python -m tools.convert {path} OUT.infernix (then run with "
                "OUT.infernix)")
    return f"model {str(path)!r} is a directory, not a .infernix file"


def gpu_present() -> bool:
    """A CUDA driver that reports at least one device (checked through ctypes only)."""
    name = ctypes.util.find_library("cuda")
    if name is None:
        return False
    try:
        driver = ctypes.CDLL(name)
        if driver.cuInit(0) != 0:
            return False
        count = ctypes.c_int(0)
        return driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    except OSError:
        return False


def choose_device(setting: str) -> str:
    """"cpu" or "cuda" from `--device` (cpu | cuda | N | auto)."""
    if setting == "cpu":
        return "cpu"
    if setting == "cuda" or setting.isdigit():
        if not gpu_present():
            raise ConfigError(f"--device {setting}: no CUDA GPU is visible here; use "
                              "--device cpu (NumPy reference backend, tiny models)")
        return "cuda"
    if setting != "auto":
        raise ConfigError(f"--device: {setting!r} is not cpu, cuda, a device index or auto")
    return "cuda" if gpu_present() else "cpu"


class _WeightProgress:
    """Weight upload progress (bytes): one transient line on a terminal, coarse plain lines
    when stderr is redirected (runtime.log.Progress)."""

    def __init__(self):
        self._progress: Optional[Progress] = None

    def __call__(self, done: int, total: int) -> None:
        if self._progress is None:
            self._progress = Progress("materializing weights", total, unit="B")
        self._progress.advance(done - self._progress.done)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()


def prefix_cache_settings(settings: Any, device: str, logger) -> dict:
    """The prefix cache's `EngineConfig` fields from the server's options. The CLI (one
    request) has no cache options and no cache; on cuda the cache waits for the CUDA runner's
    host-copy methods (`ModelRunner.save_slot` and the rest), so it is off there too."""
    off = {"prefix_cache": False, "snapshot_slots": 0, "host_cache_bytes": 0,
           "snapshot_interval": 0, "cache_file": None}
    if not hasattr(settings, "no_prefix_cache"):
        return off
    if device == "cuda":
        logger.info("prefix cache: off on --device cuda (the CUDA runner has no host copies "
                    "of slots and pages yet)")
        return off
    interval = settings.snapshot_interval
    if interval % PAGE_SIZE:
        raise ConfigError(f"--snapshot-interval: {interval} is not a multiple of {PAGE_SIZE}")
    return {"prefix_cache": not settings.no_prefix_cache,
            "snapshot_slots": settings.device_snapshot_slots,
            "host_cache_bytes": settings.host_context_mib << 20,
            "snapshot_interval": interval,
            "cache_file": settings.prefix_cache_file,    # fingerprinted once the runner exists
            "cache_save_s": settings.prefix_cache_save_mins * 60.0}


def cache_fingerprint(model_name: str, model_path: Path, runner: Any, kv_dtype: str) -> str:
    """What a prefix-cache file's arrays depend on: the model and the exact artifact file,
    the runner (its class; its compute dtype shows in the sizes), the KV format and the state
    and page sizes."""
    stat = model_path.stat()
    return (f"model={model_name};artifact={model_path.name}:{stat.st_size}:{stat.st_mtime_ns};"
            f"runner={type(runner).__name__};kv={kv_dtype};"
            f"slot={runner.slot_nbytes};page={runner.page_nbytes}")


def vision_settings(settings: Any, device: str, artifact: Any,
                    speculative: SpeculativeConfig) -> Optional[tuple[Any, Any]]:
    """(VisionConfig, ImageRules) for --vision, None without it; refuses what cannot run."""
    if not settings.vision:
        return None
    from runtime.media.image import ImageRules
    from runtime.model.vision_reference import VisionConfig

    if "vision" not in artifact.all_component_names:
        raise ConfigError("--vision: this model has no vision component (convert a checkpoint "
                          "with model.visual.* tensors)")
    if device != "cpu":
        raise ConfigError("--vision runs on the CPU backend only so far (--device cpu); the "
                          "GPU vision tower is not built yet")
    if speculative.mtp or speculative.ngram_draft_tokens:
        raise ConfigError("--vision with speculative decoding is not supported yet")
    config = artifact.component("vision").config
    tower = VisionConfig.from_dict(config)
    processor = config.get("image_processor") or {}
    defaults = ImageRules()
    rules = ImageRules(patch_size=tower.patch_size, temporal_patch_size=tower.temporal_patch_size,
                       merge_size=tower.spatial_merge_size,
                       min_pixels=int(processor.get("min_pixels") or defaults.min_pixels),
                       max_pixels=int(processor.get("max_pixels") or defaults.max_pixels),
                       mean=tuple(processor.get("mean") or defaults.mean),
                       std=tuple(processor.get("std") or defaults.std))
    return tower, rules.capped(settings.vision_max_merged)


def speculative_settings(settings: Any, device: str, artifact: Any) -> SpeculativeConfig:
    """`--spec`, `--draft-tokens` and `--ngram-*` as the engine's config; combinations that
    cannot work are ConfigErrors, never ignored."""
    if settings.draft_tokens is not None and settings.spec != "mtp":
        raise ConfigError("--draft-tokens sets the MTP drafts per round: it needs --spec mtp")
    config = SpeculativeConfig(method=settings.spec, draft_tokens=settings.draft_tokens or 3,
                               ngram_draft_tokens=settings.ngram_draft_tokens,
                               ngram_min_match=settings.ngram_min_match)
    if not config.enabled:
        return config
    if device == "cuda":
        raise ConfigError("--spec / --ngram-draft-tokens: speculative decoding runs on --device "
                          "cpu so far (the CUDA runner does not verify draft rows yet)")
    if config.mtp and "mtp" not in artifact.all_component_names:
        raise ConfigError("--spec mtp: this artifact has no MTP component (convert the "
                          "checkpoint with its mtp.* weights, or use --spec off)")
    return config


TURN_SNAPSHOTS = 4
"""Message starts of a prompt offered to the prefix cache as snapshot positions: the final
generation opener, the last user (or tool) turn, and the previous assistant turn with its user
turn, where the next request of a conversation or an edited history diverges from this one."""


def turn_starts(ids: Sequence[int], im_start: int) -> tuple[int, ...]:
    """The positions of the last `TURN_SNAPSHOTS` `<|im_start|>` markers of a rendered prompt
    (snapshot hints for the prefix cache; position 0 is no use and left out)."""
    starts = [i for i, token in enumerate(ids) if token == im_start and i > 0]
    return tuple(starts[-TURN_SNAPSHOTS:])


def word_kinds_table(token_bytes: Sequence[bytes], vocab_size: int) -> np.ndarray:
    """Per token id: how its text meets word boundaries (for the reasoning-loop guard)."""
    kinds = np.full(vocab_size, WORD_CONTINUES, dtype=np.int8)
    for token_id, data in enumerate(token_bytes[:vocab_size]):
        if not data:
            continue
        if data.isspace():
            kinds[token_id] = WORD_SEPARATOR
        elif data[:1].isspace():
            kinds[token_id] = WORD_STARTS
    return kinds


class ModelSession:
    """A loaded model, its text layer and a running engine (see the module docstring)."""

    def __init__(self, *, settings: Any, model_path: Path, model_name: str, device: str,
                 artifact: Any, runner: Any, tokenizer: Any, chat_template: Any,
                 engine: Engine, kv_capacity_tokens: int, num_lanes: int, load_seconds: float,
                 vision: Any = None):
        self.settings = settings
        self.model_path = model_path
        self.model_name = model_name
        self.device = device
        self.artifact = artifact
        self.runner = runner
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.engine = engine
        self.kv_capacity_tokens = kv_capacity_tokens
        self.num_lanes = num_lanes
        self.load_seconds = load_seconds
        # (VisionConfig, ImageRules) with --vision, else None; sources' limits always apply.
        self.vision = vision
        self.media_limits = SourceLimits(allow_remote=settings.allow_remote_media)
        self.max_context = engine.config.max_context
        self.presets = model_presets(model_name)
        self.think_end_id = tokenizer.special.think_end
        self.thinking_close_ids = tuple(tokenizer.encode(THINKING_CLOSE_TEXT))
        self._word_kinds: Optional[np.ndarray] = None
        if getattr(settings, "reasoning_loop", "off") != "off":
            # The loop guard's word table: built now rather than on the first request.
            self._word_kinds = word_kinds_table(tokenizer.token_bytes, runner.vocab_size)
        self._constraint_compiler = None

    # --- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, settings: Any, *, log=None) -> "ModelSession":
        """Load the model named by `settings` and start its engine.

        Raises ConfigError for option mistakes (exit code 2 in the CLI); the artifact, model
        and text layers raise their own errors when loading fails."""
        logger = log or get_logger("session")
        started = time.perf_counter()
        model = settings.model
        if getattr(settings, "demo", False):
            if model is not None:
                raise ConfigError("--demo runs a generated tiny model; give no model path")
            if settings.device not in ("auto", "cpu"):
                # The GPU kernels are compiled for real model shapes and the 512-token test
                # model; the demo's (real vocabulary, hidden size 256) is not among them.
                logger.warning("--demo runs on the CPU, not --device %s: no GPU kernels are "
                               "built for the demo model's shapes; give a converted model "
                               "(python -m tools.convert) to run on the GPU", settings.device)
            logger.info("demo: tiny random-weight model with the real Qwen vocabulary, CPU")
            model_path = demo_model_path(logger)
            device = "cpu"
        else:
            if model is None:
                raise ConfigError("no model given: pass MODEL (a .infernix file), set `model` "
                                  "in --config, or use --demo")
            model_path = Path(model)
            if not model_path.exists():
                raise ConfigError(f"model {model!r} does not exist")
            if model_path.is_dir():
                raise ConfigError(_directory_given(model_path))
            device = choose_device(settings.device)
        if settings.prefill_chunk % PAGE_SIZE:
            raise ConfigError(f"--prefill-chunk: {settings.prefill_chunk} is not a multiple "
                              f"of {PAGE_SIZE}")
        num_lanes = getattr(settings, "max_concurrency", 1)
        max_context = settings.max_context
        capacity = settings.kv_capacity
        if capacity is None or capacity == "auto":
            if capacity == "auto" and device == "cpu":
                logger.info("--kv-capacity auto: the CPU backend sizes the pool from "
                            "--max-context")
            capacity = max_context * num_lanes
        num_pages = pages_for(capacity)

        from runtime.artifact import open_artifact
        from runtime.text.chat import load_chat_template
        from runtime.text.tokenizer import Tokenizer

        logger.info("loading %s on %s", model_path, device)
        phase = time.perf_counter()

        def phase_done(what: str) -> None:
            nonlocal phase
            now = time.perf_counter()
            logger.debug("%s: %.2f s", what, now - phase)
            phase = now

        artifact = open_artifact(model_path)
        text = artifact.component("text")
        model_name = str(artifact.metadata.get("name") or model_path.stem)
        native = text.config.get("max_position_embeddings")
        if isinstance(native, int) and max_context > native:
            artifact.close()
            raise ConfigError(f"--max-context {max_context} exceeds the model's native context "
                              f"of {native} tokens")
        phase_done("artifact opened")
        tokenizer = Tokenizer.from_artifact_resources(text.resources)
        phase_done(f"tokenizer loaded ({tokenizer.vocab_size} tokens)")
        fallback = "qwen3_next" if "next" in str(text.config.get("model_type", "")) else "qwen3_5"
        chat_template = load_chat_template(text.resources, settings.chat_template,
                                           fallback=fallback)
        if chat_template.origin.startswith("builtin:"):
            logger.warning("the artifact has no chat template; using the maintained %s",
                           chat_template.origin)
        phase_done(f"chat template loaded ({chat_template.origin})")
        prefill_chunk = min(settings.prefill_chunk, max_context)
        cache = prefix_cache_settings(settings, device, logger)
        speculative = speculative_settings(settings, device, artifact)
        vision = vision_settings(settings, device, artifact, speculative)
        # Slots: the lanes and their verification snapshots, then the prefix cache's.
        reserved = SlotLayout.for_config(num_lanes, speculative).reserved
        runner = cls._make_runner(device, artifact, num_pages,
                                  reserved + cache["snapshot_slots"], prefill_chunk,
                                  settings, logger, mtp=speculative.mtp,
                                  vision=vision is not None)
        phase_done(f"weights loaded ({type(runner).__name__})")
        if cache["cache_file"] is not None:
            cache["cache_fingerprint"] = cache_fingerprint(model_name, model_path, runner,
                                                           settings.kv_dtype)
        engine_config = EngineConfig(
            num_lanes=num_lanes, max_context=max_context, prefill_chunk=prefill_chunk,
            max_waiting=getattr(settings, "max_pending_requests", 0), num_pages=num_pages,
            speculative=speculative, **cache)
        # A CUDA context is current per thread: the engine thread must make it its own.
        on_start = runner.device.make_current if device == "cuda" else None
        engine = Engine(runner, engine_config, logger=get_logger("engine"),
                        on_thread_start=on_start).start()
        phase_done("engine started")
        seconds = time.perf_counter() - started
        session = cls(settings=settings, model_path=model_path, model_name=model_name,
                      device=device, artifact=artifact, runner=runner, tokenizer=tokenizer,
                      chat_template=chat_template, engine=engine,
                      kv_capacity_tokens=num_pages * PAGE_SIZE, num_lanes=num_lanes,
                      load_seconds=seconds, vision=vision)
        logger.info("engine ready: %s, %s, context %d, KV pool %d tokens (%d pages), %d lane%s, "
                    "template %s, presets %s (%.1f s)", model_name, device, max_context,
                    num_pages * PAGE_SIZE, num_pages, num_lanes, "" if num_lanes == 1 else "s",
                    chat_template.origin, session.presets.name, seconds)
        return session

    @staticmethod
    def _make_runner(device: str, artifact: Any, num_pages: int, num_slots: int,
                     prefill_chunk: int, settings: Any, logger, mtp: bool = False,
                     vision: bool = False) -> Any:
        """num_slots: the lanes and their verification snapshots, then the prefix cache's
        snapshot slots. mtp: load the MTP head (CPU backend; `speculative_settings` refuses
        speculative decoding on cuda)."""
        synthetic = getattr(settings, "synthetic_weights", None)
        if synthetic is not None and device != "cuda":
            raise ConfigError(f"--synthetic-weights fills weights on the GPU; the {device} backend "
                              "reads them from the model (use --device cuda)")
        if device == "cuda":
            if settings.device.isdigit() and settings.device != "0":
                raise ConfigError(f"--device {settings.device}: the CUDA runner drives device 0 "
                                  "only so far")
            module = importlib.import_module(CUDA_RUNNER_MODULE)
            progress = _WeightProgress()
            num_lanes = getattr(settings, "max_concurrency", 1)
            shape = {"num_pages": num_pages, "num_slots": num_slots,
                     "max_batch": min(b for b in (1, 2, 4, 8) if b >= num_lanes),
                     "prefill_chunk": prefill_chunk, "max_context": settings.max_context,
                     "cuda_graphs": not settings.no_cuda_graph}
            try:
                if synthetic is not None:
                    logger.warning("--synthetic-weights %d: random weights, the output is noise",
                                   synthetic)
                    text = artifact.component("text")
                    config = ModelConfig.from_dict(text.config)
                    # The artifact's projection formats (an FP8 model gets random FP8 weights).
                    return module.CudaRunner.synthetic(config, synthetic, **shape,
                                                       weight_formats=lambda name: text.entry(name).format)
                return module.CudaRunner.from_artifact(artifact, progress=progress, **shape)
            except NotImplementedError as exc:      # a model the CUDA runner cannot run yet
                raise ConfigError(f"--device cuda: {exc}; --device cpu runs it on the NumPy "
                                  "reference") from None
            finally:
                progress.close()
        from runtime.model.numpy_runner import NumpyRunner

        if settings.kv_dtype != "bf16":
            raise ConfigError(f"--kv-dtype {settings.kv_dtype}: the CPU backend keeps KV in "
                              "float32 and accepts only the default bf16")
        logger.debug("CPU backend: NumPy reference in float32 (KV kept in float32; "
                     "--no-cuda-graph has no effect)")
        return NumpyRunner.from_artifact(artifact, num_pages=num_pages, num_slots=num_slots,
                                         dtype=np.float32, mtp=mtp, vision=vision)

    def device_memory_bytes(self) -> Optional[int]:
        """Device memory the runner reserved at startup (None on the CPU backend)."""
        arenas = getattr(self.runner, "arenas", None)
        if arenas is None:
            return None
        return sum(arena.capacity for arena in arenas.arenas.values())

    def close(self) -> None:
        self.engine.shutdown()
        close_runner = getattr(self.runner, "close", None)
        if close_runner is not None:
            close_runner()                       # device memory goes back with the engine
        self.artifact.close()

    def __enter__(self) -> "ModelSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- prompts ----------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Optional[Sequence[Mapping[str, Any]]] = None,
               enable_thinking: Optional[bool] = None, reasoning_effort: Optional[str] = None,
               preserve_thinking: bool = False, add_generation_prompt: bool = True,
               **template_kwargs: Any) -> RenderedPrompt:
        """Render a chat with the session's template to token ids. `None` options take the
        template's defaults; `reasoning_effort="none"` means thinking off."""
        if reasoning_effort == "none" and enable_thinking is None:
            enable_thinking = False
        from runtime.media.placement import expand_pads, resolve_media

        # Media parts are decoded here (raising MediaError naming the part), before the template.
        rules = self.vision[1] if self.vision is not None else None
        messages, images = resolve_media(messages, rules, self.media_limits)
        ids = self.chat_template.render_ids(
            self.tokenizer, messages, tools=list(tools) if tools else None,
            enable_thinking=enable_thinking, reasoning_effort=reasoning_effort,
            preserve_thinking=preserve_thinking, add_generation_prompt=add_generation_prompt,
            **template_kwargs)
        media: tuple = ()
        if images:
            ids, media = expand_pads(ids, images, self.vision[0].image_token_id,
                                     self.vision[0].spatial_merge_size)
        return RenderedPrompt(ids=tuple(ids), thinking=self.ends_in_thinking(ids), media=media)

    def ends_in_thinking(self, ids: Sequence[int]) -> bool:
        """The prompt leaves the final turn's think block open: generation starts in thinking."""
        return prompt_ends_in_reasoning(ids, self.tokenizer)

    def count_tokens(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> int:
        return len(self.render(messages, **options).ids)

    # --- request building -------------------------------------------------------------------

    def sampling(self, thinking: bool, request: SamplingOverrides = SamplingOverrides(), *,
                 constrained: bool = False) -> SamplingParams:
        """Resolved sampling: this model's preset for the mode < process flags (including the
        `--seed` default) < `request` < greedy."""
        preset = self.presets.thinking if thinking else self.presets.non_thinking
        return resolve_sampling(preset, SamplingOverrides.from_settings(self.settings), request,
                                constrained=constrained)

    @property
    def word_kinds(self) -> np.ndarray:
        if self._word_kinds is None:
            self._word_kinds = word_kinds_table(self.tokenizer.token_bytes,
                                                self.runner.vocab_size)
        return self._word_kinds

    def thinking_control(self, thinking: bool, *, budget: Optional[int] = None,
                         loop_guard: str = "off") -> ThinkingControl:
        """The engine's thinking controls for a prompt that does (not) end in thinking."""
        if not thinking:
            return ThinkingControl(think_end_id=self.think_end_id)
        return ThinkingControl(
            starts_in_thinking=True, think_end_id=self.think_end_id, budget=budget,
            close_ids=self.thinking_close_ids, loop_guard=loop_guard,
            word_kinds=self.word_kinds if loop_guard != "off" else None)

    def stop_token_ids(self, extra: Sequence[int] = ()) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_ids) | frozenset(int(t) for t in extra)

    @property
    def constraint_compiler(self):
        """The llguidance compiler for this model (built on first use: a few seconds)."""
        if self._constraint_compiler is None:
            from runtime.text.constraints import ConstraintCompiler

            self._constraint_compiler = ConstraintCompiler(
                self.artifact.component("text").resources["tokenizer.json"],
                vocab_size=self.runner.vocab_size, eos_ids=self.tokenizer.eos_ids)
        return self._constraint_compiler

    def compile_constraint(self, spec: Any, thinking: bool, *, tool_calls: bool = False):
        """A fresh per-request constraint; the grammar starts after `</think>` in thinking.
        tool_calls: the spec covers tool calls, so `<tool_call>` is not allowed inside the
        think block (the output parser would take it as a call the grammar never checked)."""
        banned = (self.tokenizer.special.tool_call,) if tool_calls and thinking else ()
        return self.constraint_compiler.compile(
            spec, starts_in_thinking=thinking, think_end_id=self.think_end_id,
            thinking_banned_ids=banned)

    def build_request(self, prompt: RenderedPrompt, *, max_new_tokens: int,
                      sampling: Optional[SamplingParams] = None,
                      stop_token_ids: Sequence[int] = (), thinking_budget: Optional[int] = None,
                      loop_guard: str = "off", constraint: Any = None, logprobs: int = 0,
                      request_id: Optional[str] = None) -> EngineRequest:
        """An `EngineRequest` for a rendered prompt, with this session's defaults."""
        if sampling is None:
            sampling = self.sampling(prompt.thinking, constrained=constraint is not None)
        return EngineRequest(
            request_id=request_id or self.engine.new_request_id(), prompt_ids=prompt.ids,
            sampling=sampling, max_new_tokens=max_new_tokens,
            stop_token_ids=self.stop_token_ids(stop_token_ids),
            thinking=self.thinking_control(prompt.thinking, budget=thinking_budget,
                                           loop_guard=loop_guard),
            constraint=constraint, logprobs=logprobs, media=prompt.media,
            snapshot_positions=turn_starts(prompt.ids, self.tokenizer.special.im_start))
