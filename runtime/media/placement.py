"""Media parts of a chat -> decoded images, and their pads in the rendered prompt -> `MediaSpan`s.

`resolve_media` walks the messages in order (the order the template writes them), checks each
image part, decodes and preprocesses it, and leaves `{"type": "image"}` for the template (which
writes `<|vision_start|><|image_pad|><|vision_end|>`). Without vision an image is refused, except
inside a tool result, where it becomes a short text note so agent loops keep going.
`expand_pads` widens each single pad to the image's merged token count and records where it is.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from runtime.media.image import ImageRules, PreparedImage, decode_image, prepare_image
from runtime.media.sources import MediaError, SourceLimits, part_kind, part_source, read_source
from runtime.model.runner import MediaSpan

VISION_OFF_NOTE = "[image omitted: vision is off]"


def resolve_media(messages: Sequence[Mapping[str, Any]], rules: Optional[ImageRules],
                  limits: SourceLimits) -> tuple[list[dict], list[PreparedImage]]:
    """(messages for the template, images in prompt order); rules None means vision is off.
    A part may carry `where` (the API's name for it) for error messages."""
    resolved, images = [], []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            resolved.append(dict(message))
            continue
        parts = []
        for p, part in enumerate(content):
            kind = part_kind(part)
            if kind is None:
                parts.append(part)
                continue
            where = str(part.get("where") or f"messages[{m}].content[{p}]")
            if kind == "video":
                raise MediaError(where, "video input is not supported yet (images only)")
            if rules is None:
                if message.get("role") == "tool":
                    parts.append({"type": "text", "text": VISION_OFF_NOTE})
                    continue
                raise MediaError(where, "image input needs vision: start with --vision (and a "
                                        "model that has a vision component)")
            data = read_source(part_source(part, where), where, limits)
            images.append(prepare_image(decode_image(data, where), rules, where))
            parts.append({"type": "image"})
        resolved.append(dict(message, content=parts))
    return resolved, images


def expand_pads(ids: Sequence[int], images: Sequence[PreparedImage], image_pad: int,
                merge: int) -> tuple[tuple[int, ...], tuple[MediaSpan, ...]]:
    """Each `image_pad` of the rendered ids, in order, widened to its image's merged tokens."""
    found = sum(1 for token in ids if token == image_pad)
    if found != len(images):
        raise MediaError("messages", f"the chat template placed {found} image(s) for "
                                     f"{len(images)} image part(s)")
    out: list[int] = []
    spans = []
    remaining = iter(images)
    for token in ids:
        if token != image_pad:
            out.append(token)
            continue
        image = next(remaining)
        spans.append(MediaSpan(offset=len(out), grid=image.grid, patches=image.patches,
                               digest=image.digest))
        out.extend([image_pad] * image.merged_tokens(merge))
    return tuple(out), tuple(spans)
