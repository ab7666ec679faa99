"""Image and video content parts of the three APIs -> the parts `runtime.media.placement` reads.

Each API names its images its own way: Chat `{"type": "image_url", "image_url": {"url"}}`,
Responses `{"type": "input_image", "image_url": "data:..."}`, Anthropic
`{"type": "image", "source": {"type": "base64", "media_type", "data"}}`. Each becomes
`{"type": "image", "image": SOURCE, "where": WIRE_PATH}`. Video exists in Chat only
(`{"type": "video_url", "video_url": {"url"}}`, as vLLM and SGLang take it) and becomes
`{"type": "video", "video": SOURCE, "where": WIRE_PATH}`; the Responses and Anthropic APIs have
no video part, so one there is a 400 pointing to Chat. The session decodes media when the prompt
is rendered, and bad media (corrupt, not an image or video, too large or long, a remote URL without
`--allow-remote-media`, vision off) is a `MediaError` whose `where` is the wire path, answered
with a 400 naming it. Here only the shape and the source's kind are checked (a data URI or an
HTTP(S) URL: never a path on the server's disk); reading and decoding need the session's limits
and rules.

Content without images stays one string (exactly `text_of_parts`), so text-only prompts render
as before; content with images is a list of text and image parts in the client's order.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from protocols.errors import invalid, unsupported
from protocols.job import get_str, text_of_parts

# (part, its wire path) -> the image's source string, or None when the part is not an image.
ImageSource = Callable[[dict, str], Optional[str]]


VIDEO_TYPES = ("video", "video_url", "input_video")


def image_part(source: str, where: str, kind: str = "image") -> dict:
    """The part for `runtime.media` (kind "image" or "video"); a source that is not a data URI or
    an HTTP(S) URL is refused here, because the runtime reads any other string as a path on the
    server's own disk."""
    scheme = source.partition(":")[0].lower()
    if scheme not in ("data", "http", "https"):
        example = "data:image/png;base64" if kind == "image" else "data:video/mp4;base64"
        raise invalid(where, f"{'an image' if kind == 'image' else 'a video'} source must be a "
                             f"base64 data URI ({example},...) or an http(s) URL")
    return {"type": kind, kind: source, "where": where}


def no_video_here(part: dict, where: str, api: str) -> None:
    """APIs without a video part: a video-looking part is refused with the way to send it."""
    if part.get("type") in VIDEO_TYPES:
        raise unsupported(f"{where}.type", f"video input is not part of the {api} API; send it "
                                           "to /v1/chat/completions as a video_url part")


def content_with_images(content: Any, where: str, image_source: ImageSource,
                        allowed=("text",), *, text_key: str = "text",
                        video_source: Optional[ImageSource] = None) -> Union[str, list]:
    """A message's content: one string without media, else text, image and video parts in
    order. Text parts are checked as `text_of_parts` checks them (types outside `allowed`
    refused)."""
    if not isinstance(content, list):
        return text_of_parts(content, where, allowed, text_key=text_key)

    def media(part: Any, part_where: str) -> Optional[tuple[str, str]]:
        if not isinstance(part, dict):
            return None
        source = image_source(part, part_where)
        if source is not None:
            return "image", source
        source = video_source(part, part_where) if video_source is not None else None
        return ("video", source) if source is not None else None

    sources = [media(part, f"{where}[{index}]") for index, part in enumerate(content)]
    if all(source is None for source in sources):
        return text_of_parts(content, where, allowed, text_key=text_key)
    # The images as empty strings (which pass unchecked), so text parts' errors keep their index.
    text_of_parts(["" if source is not None else part for part, source in zip(content, sources)],
                  where, allowed, text_key=text_key)
    parts: list[dict] = []
    for index, (part, source) in enumerate(zip(content, sources)):
        if source is not None:
            parts.append(image_part(source[1], f"{where}[{index}]", source[0]))
        else:
            parts.append({"type": "text",
                          "text": part if isinstance(part, str) else part.get(text_key, "")})
    return parts


def joined(first: Union[str, list], separator: str, second: Union[str, list]) -> Union[str, list]:
    """Two contents as one (consecutive user turns merged); a list as soon as either has images."""
    if isinstance(first, str) and isinstance(second, str):
        return first + separator + second

    def as_parts(content: Union[str, list]) -> list:
        return [{"type": "text", "text": content}] if isinstance(content, str) else content

    return as_parts(first) + [{"type": "text", "text": separator}] + as_parts(second)


def chat_image(part: dict, where: str) -> Optional[str]:
    """Chat Completions: `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` (a bare
    string is accepted too, as the CLI does)."""
    return _chat_url(part, where, "image_url")


def chat_video(part: dict, where: str) -> Optional[str]:
    """Chat Completions: `{"type": "video_url", "video_url": {"url": ...}}` (or a bare string)."""
    return _chat_url(part, where, "video_url")


def _chat_url(part: dict, where: str, kind: str) -> Optional[str]:
    """The URL of a Chat part of type `kind` (an object with `url`, or a bare string); None
    for a part of another type."""
    if part.get("type") != kind:
        return None
    value = part.get(kind)
    if isinstance(value, dict):
        return get_str(value, "url", f"{where}.{kind}.url", required=True)
    if isinstance(value, str):
        return value
    raise invalid(f"{where}.{kind}", "must be an object with a string `url`")


def responses_image(part: dict, where: str) -> Optional[str]:
    """Responses: `{"type": "input_image", "image_url": "data:...", "detail": ...}`; `file_id`
    names an upload of the Files API, which this server does not have."""
    no_video_here(part, where, "Responses")
    if part.get("type") != "input_image":
        return None
    if part.get("file_id") is not None:
        raise unsupported(f"{where}.file_id", "file inputs are not supported (this server has "
                                              "no Files API); send image_url as a data URI")
    return get_str(part, "image_url", f"{where}.image_url", required=True)


def anthropic_image(part: dict, where: str) -> Optional[str]:
    """Anthropic: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}` (as a
    data URI) or `{"type": "url", "url"}`; `file` sources need the Files API (not here)."""
    no_video_here(part, where, "Anthropic Messages")
    if part.get("type") != "image":
        return None
    source = part.get("source")
    if not isinstance(source, dict):
        raise invalid(f"{where}.source", "must be an object")
    kind = source.get("type")
    if kind == "base64":
        media_type = get_str(source, "media_type", f"{where}.source.media_type", required=True)
        data = get_str(source, "data", f"{where}.source.data", required=True)
        return f"data:{media_type};base64,{data}"
    if kind == "url":
        return get_str(source, "url", f"{where}.source.url", required=True)
    raise unsupported(f"{where}.source.type", f"image sources of type {kind!r} are not "
                                              "supported (use base64 or url)")
