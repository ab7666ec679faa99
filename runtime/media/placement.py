"""Media parts of a chat -> decoded images and videos, and their pads in the rendered prompt ->
`MediaSpan`s.

`resolve_media` walks the messages in order (the order the template writes them), checks each
image or video part, decodes and preprocesses it, and leaves `{"type": "image"}` /
`{"type": "video"}` for the template (which writes `<|vision_start|><|image_pad|><|vision_end|>`
or the same with `<|video_pad|>`). Without vision media is refused, except inside a tool result,
where it becomes a short text note so agent loops keep going.
`video_replacements` gives each video's frame-group blocks (`PreparedVideo.prompt_text`), which
the template rendering puts in place of the video's one block; `expand_pads` then widens each
single pad to its image's or frame group's merged token count and records where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from runtime.media.image import ImageRules, PreparedImage, decode_image, prepare_image
from runtime.media.sources import MediaError, SourceLimits, part_kind, part_source, read_source
from runtime.media.video import VIDEO_BLOCK, PreparedVideo, VideoRules, decode_video, \
    prepare_video
from runtime.model.runner import MediaSpan

OFF_NOTES = {"image": "[image omitted: vision is off]", "video": "[video omitted: vision is off]"}
VISION_OFF_NOTE = OFF_NOTES["image"]
Prepared = Union[PreparedImage, PreparedVideo]


@dataclass(frozen=True)
class MediaRules:
    """The model's preprocessing of each kind of media (from the artifact's vision config)."""

    image: ImageRules
    video: VideoRules


def resolve_media(messages: Sequence[Mapping[str, Any]], rules: Optional[MediaRules],
                  limits: SourceLimits) -> tuple[list[dict], list[Prepared]]:
    """(messages for the template, images and videos in prompt order); rules None means vision
    is off. A part may carry `where` (the API's name for it) for error messages."""
    resolved, items = [], []
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
            if rules is None:
                if message.get("role") == "tool":
                    parts.append({"type": "text", "text": OFF_NOTES[kind]})
                    continue
                raise MediaError(where, f"{kind} input needs vision: start with --vision (and a "
                                        "model that has a vision component)")
            data = read_source(part_source(part, where), where, limits)
            if kind == "video":
                items.append(prepare_video(decode_video(data, where, rules.video), rules.video,
                                           where))
            else:
                items.append(prepare_image(decode_image(data, where), rules.image, where))
            parts.append({"type": kind})
        resolved.append(dict(message, content=parts))
    return resolved, items


def video_replacements(items: Sequence[Prepared]) -> list[tuple[str, str]]:
    """(the template's block, the frame-group blocks) for each video, in prompt order."""
    return [("".join(VIDEO_BLOCK), item.prompt_text()) for item in items
            if isinstance(item, PreparedVideo)]


def expand_pads(ids: Sequence[int], items: Sequence[Prepared], image_pad: int,
                merge: int, video_pad: Optional[int] = None
                ) -> tuple[tuple[int, ...], tuple[MediaSpan, ...]]:
    """Each `image_pad` of the rendered ids, in order, widened to its image's merged tokens;
    each `video_pad` (one per frame group after `video_replacements`) to its group's."""
    blocks = []                          # (pad id, patches, grid, digest, tokens) in order
    for item in items:
        if isinstance(item, PreparedVideo):
            if video_pad is None:
                raise MediaError("messages", "this model's vision config names no video token "
                                             "(convert it again to take video input)")
            blocks += [(video_pad, *item.group(g), item.group_tokens(merge))
                       for g in range(item.grid[0])]
        else:
            blocks.append((image_pad, item.patches, item.grid, item.digest,
                           item.merged_tokens(merge)))
    for pad, noun, want in ((image_pad, "image", "image part(s)"),
                            (video_pad, "video frame group", "video frame group(s)")):
        found = sum(1 for token in ids if token == pad)
        expected = sum(1 for block in blocks if block[0] == pad)
        if pad is not None and found != expected:
            raise MediaError("messages", f"the chat template placed {found} {noun}(s) for "
                                         f"{expected} {want}")
    out: list[int] = []
    spans = []
    remaining = iter(blocks)
    for token in ids:
        if token not in (image_pad, video_pad):
            out.append(token)
            continue
        pad, patches, grid, digest, tokens = next(remaining)
        if pad != token:
            raise MediaError("messages", "the chat template placed the media in another order "
                                         "than the parts")
        spans.append(MediaSpan(offset=len(out), grid=grid, patches=patches, digest=digest))
        out.extend([pad] * tokens)
    return tuple(out), tuple(spans)
