"""Registered sampling presets per model and thinking mode, and how settings resolve.

When a sampling setting is omitted everywhere, the general-task preset of the loaded model for
the rendered prompt mode applies (seed 000's table). Precedence, lowest first:

    preset  <  process flag (--temperature ...)  <  request field  <  greedy (flag or request)

With an output constraint the preset's presence penalty becomes 0 (an explicit flag or request
field still wins): penalising repeats fights a grammar that must repeat `"` and `,`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Optional

from runtime.engine.api import SamplingParams
from runtime.model.sampling import TOP_K_CAP


@dataclass(frozen=True)
class SamplingPreset:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float = 0.0


THINKING_GENERAL = SamplingPreset(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0,
                                  presence_penalty=0.0)
NON_THINKING_GENERAL = SamplingPreset(temperature=0.7, top_p=0.80, top_k=20, min_p=0.0,
                                      presence_penalty=1.5)


@dataclass(frozen=True)
class ModelPresets:
    """The presets of one registered model; `pattern` matches its normalised name."""

    name: str
    pattern: str
    thinking: SamplingPreset
    non_thinking: SamplingPreset


# Frequency penalty is 0 in every registered preset. Order matters: first match wins.
REGISTERED: tuple[ModelPresets, ...] = (
    ModelPresets("Qwen3.6-35B-A3B", r"qwen3[._-]?6.*35b[._-]?a3b",
                 replace(THINKING_GENERAL, presence_penalty=1.5), NON_THINKING_GENERAL),
    ModelPresets("Qwen3.6-27B", r"qwen3[._-]?6.*27b", THINKING_GENERAL, NON_THINKING_GENERAL),
    ModelPresets("Qwen3.8-27B", r"qwen3[._-]?8.*27b", THINKING_GENERAL, NON_THINKING_GENERAL),
    ModelPresets("Qwen3.8-Flash-Next", r"qwen3[._-]?8.*flash[._-]?next", THINKING_GENERAL,
                 NON_THINKING_GENERAL),
)
GENERAL = ModelPresets("general Qwen preset", "", THINKING_GENERAL, NON_THINKING_GENERAL)


def model_presets(model_name: Optional[str]) -> ModelPresets:
    """The registered presets whose pattern matches `model_name`, else the general Qwen ones."""
    normalised = (model_name or "").lower()
    for entry in REGISTERED:
        if re.search(entry.pattern, normalised):
            return entry
    return GENERAL


def preset_for(model_name: Optional[str], thinking: bool) -> SamplingPreset:
    entry = model_presets(model_name)
    return entry.thinking if thinking else entry.non_thinking


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling settings given by one layer (process flags or a request); None = not given."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    greedy: Optional[bool] = None

    @classmethod
    def from_settings(cls, settings) -> "SamplingOverrides":
        """The process-level overrides of a CliSettings / ServeSettings object."""
        return cls(temperature=settings.temperature, top_p=settings.top_p,
                   top_k=settings.top_k, min_p=settings.min_p,
                   presence_penalty=settings.presence_penalty,
                   frequency_penalty=settings.frequency_penalty,
                   seed=settings.seed, greedy=True if settings.greedy else None)


def resolve_sampling(preset: SamplingPreset, process: SamplingOverrides = SamplingOverrides(),
                     request: SamplingOverrides = SamplingOverrides(), *,
                     constrained: bool = False, default_seed: int = 0) -> SamplingParams:
    """Combine the layers into the engine's fully resolved `SamplingParams`."""
    values = {f.name: getattr(preset, f.name) for f in fields(SamplingPreset)}
    if constrained:
        values["presence_penalty"] = 0.0
    for layer in (process, request):
        for name in values:
            given = getattr(layer, name)
            if given is not None:
                values[name] = given
    top_k = int(values["top_k"])
    values["top_k"] = TOP_K_CAP if top_k <= 0 else min(top_k, TOP_K_CAP)
    seed = request.seed if request.seed is not None else (
        process.seed if process.seed is not None else default_seed)
    greedy = bool(process.greedy) or bool(request.greedy)
    return SamplingParams(seed=int(seed), greedy=greedy, **values)
