"""`ModelSession`: a loaded model, its text layer and a running engine (the package docstring
shows the calls), and the prompt side of a request: rendering a chat to token ids with its
media, the model's sampling presets, the thinking controls, constraints and `EngineRequest`s.

`ModelSession.open` loads in order: the model file and device (`model_files`), the artifact,
the tokenizer and the chat template (the artifact's or `--chat-template`), the engine settings
(`engine_settings`: KV pool, prefix cache, speculative decoding, vision), the runner
(`backend`), then starts the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from runtime.config import ConfigError, serving
from runtime.engine.api import EngineRequest, SamplingParams, ThinkingControl
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.presets import SamplingOverrides, model_presets, resolve_sampling
from runtime.engine.thinking import WORD_CONTINUES, WORD_SEPARATOR, WORD_STARTS
from runtime.log import get_logger
from runtime.media.sources import SourceLimits
from runtime.model.runner import PAGE_SIZE
from runtime.session.backend import make_runner, synthetic_shape
from runtime.session.engine_settings import (cache_fingerprint, kv_pool_pages, route_summary,
                                             prefix_cache_settings, runner_slots,
                                             speculative_settings, vision_settings)
from runtime.session.model_files import model_and_device
from runtime.text.parser import prompt_ends_in_reasoning

# Qwen's canonical early-close guidance and `</think>`, inserted when the thinking budget runs
# out. The blank line after `</think>` is left to the model (and to a constraint's separator).
THINKING_CLOSE_TEXT = ("\n\nConsidering the limited time by the user, I have to give the "
                       "solution based on the thinking directly now.\n</think>")


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat rendered to token ids.

    thinking: the prompt ends inside an open think block (thinking mode: the thinking presets
        apply and the thinking controls are armed).
    """

    ids: tuple[int, ...]
    thinking: bool
    media: tuple = ()      # `MediaSpan`s of the prompt's images (pads already expanded)
    # Seconds spent: decoding images and rendering the template to text / tokenizing that
    # text (request phases; not part of the prompt's identity).
    render_s: float = field(default=0.0, compare=False)
    tokenize_s: float = field(default=0.0, compare=False)


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
        # (VisionConfig, MediaRules) with --vision, else None; sources' limits always apply.
        self.vision = vision
        self.media_limits = SourceLimits(allow_remote=settings.allow_remote_media)
        self.max_context = engine.config.max_context
        self.presets = model_presets(model_name)
        self.think_end_id = tokenizer.special.think_end
        self.thinking_close_ids = tuple(tokenizer.encode(THINKING_CLOSE_TEXT))
        self._word_kinds: Optional[np.ndarray] = None
        if settings.reasoning_loop != "off":
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
        model_path, device = model_and_device(settings, logger)
        if settings.prefill_chunk % PAGE_SIZE:
            raise ConfigError(f"--prefill-chunk: {settings.prefill_chunk} is not a multiple "
                              f"of {PAGE_SIZE}")
        num_lanes = settings.max_concurrency if serving(settings) else 1
        max_context = settings.max_context
        num_pages = kv_pool_pages(settings, device, num_lanes, logger)

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
        shape = None
        if settings.synthetic_shape is not None and settings.synthetic_weights is not None:
            # The shape run is the one whose context counts (MODEL only lends its tokenizer).
            try:
                shape = synthetic_shape(settings.synthetic_shape, text.config)
            except ConfigError:
                artifact.close()
                raise
            native = shape.max_position_embeddings
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
        cache = prefix_cache_settings(settings)
        speculative = speculative_settings(settings, device, artifact)
        vision = vision_settings(settings, device, artifact, speculative)
        runner = make_runner(device, artifact, num_pages, num_lanes,
                             runner_slots(num_lanes, speculative, cache), prefill_chunk,
                             settings, logger, mtp=speculative.mtp, vision=vision is not None,
                             shape_config=shape)
        phase_done(f"weights loaded ({type(runner).__name__})")
        if cache["cache_file"] is not None or cache["ssd_dir"] is not None:
            cache["cache_fingerprint"] = cache_fingerprint(model_name, model_path, runner,
                                                           settings.kv_dtype)
        engine_config = EngineConfig(
            num_lanes=num_lanes, max_context=max_context, prefill_chunk=prefill_chunk,
            max_waiting=settings.max_pending_requests if serving(settings) else 0, num_pages=num_pages,
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
        logger.info(route_summary(device, cache))  # before "engine ready": the last line before output
        logger.info("engine ready: %s, %s, context %d, KV pool %d tokens (%d pages), %d lane%s, "
                    "template %s, presets %s (%.1f s)", model_name, device, max_context,
                    num_pages * PAGE_SIZE, num_pages, num_lanes, "" if num_lanes == 1 else "s",
                    chat_template.origin, session.presets.name, seconds)
        return session

    def device_memory_bytes(self) -> Optional[int]:
        """Device memory the runner reserved at startup (None on the CPU backend)."""
        return self.runner.device_bytes or None

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
        from runtime.media.placement import expand_pads, resolve_media, video_replacements
        from runtime.text.chat import encode_rendered

        # Media parts are decoded here (raising MediaError naming the part), before the template.
        started = time.perf_counter()
        rules = self.vision[1] if self.vision is not None else None
        messages, items = resolve_media(messages, rules, self.media_limits)
        text = self.chat_template.render_marked(
            self.tokenizer, messages, tools=list(tools) if tools else None,
            enable_thinking=enable_thinking, reasoning_effort=reasoning_effort,
            preserve_thinking=preserve_thinking, add_generation_prompt=add_generation_prompt,
            replacements=video_replacements(items), **template_kwargs)
        rendered = time.perf_counter()
        ids = encode_rendered(self.tokenizer, text)
        media: tuple = ()
        if items:
            tower = self.vision[0]
            ids, media = expand_pads(ids, items, tower.image_token_id,
                                     tower.spatial_merge_size, tower.video_token_id)
        return RenderedPrompt(ids=tuple(ids), thinking=self.ends_in_thinking(ids), media=media,
                              render_s=rendered - started,
                              tokenize_s=time.perf_counter() - rendered)

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
            from runtime.text.constraints_compiler import ConstraintCompiler

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
