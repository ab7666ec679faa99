"""Media sources of content parts -> bytes, with limits, and the error that names the part.

A part is `{"type": "image", "image": SOURCE}` or `{"type": "image_url", "image_url": SOURCE}`
(video: `video` / `video_url` likewise) where SOURCE is a string or `{"url": string}` (OpenAI's
shape); the protocols translate their own part types into these. A source is a local path (or `file://` URL), a base64 data URI, or an
HTTP(S) URL, fetched only when the settings allow remote media.
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

IMAGE_PART_TYPES = ("image", "image_url")
VIDEO_PART_TYPES = ("video", "video_url")


class MediaError(ValueError):
    """Bad media input: `where` names the part (e.g. `messages[1].content[0]`), the message says
    what is wrong. The server answers it with a 400, the CLI with exit code 2."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where
        self.reason = message


@dataclass(frozen=True)
class SourceLimits:
    """max_bytes: largest encoded file accepted from any source; allow_remote: HTTP(S) URLs are
    fetched (off by default: a server should not reach the network for a client unasked);
    timeout_s: the whole remote fetch must finish within it."""

    max_bytes: int = 32 << 20
    allow_remote: bool = False
    timeout_s: float = 10.0


def part_kind(part: Any) -> str | None:
    """"image", "video" or None (not a media part), by `type` or by a source key."""
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind in IMAGE_PART_TYPES or (kind is None and any(k in part for k in IMAGE_PART_TYPES)):
        return "image"
    if kind in VIDEO_PART_TYPES or (kind is None and any(k in part for k in VIDEO_PART_TYPES)):
        return "video"
    return None


def part_source(part: Mapping[str, Any], where: str) -> str:
    """The source string of an image or video part."""
    for key in IMAGE_PART_TYPES + VIDEO_PART_TYPES:
        if key in part:
            value = part[key]
            if isinstance(value, Mapping):
                value = value.get("url")
            if isinstance(value, str) and value:
                return value
            raise MediaError(where, f"`{key}` must be a non-empty string or an object with a "
                                    "string `url`")
    raise MediaError(where, "a media part needs an `image`, `image_url`, `video` or `video_url` "
                            "source")


def read_source(source: str, where: str, limits: SourceLimits) -> bytes:
    """The encoded bytes behind `source` (see the module docstring)."""
    if source.startswith("data:"):
        return _data_uri(source, where, limits)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return _remote(source, where, limits)
    if scheme == "file":
        source = urllib.parse.unquote(urllib.parse.urlsplit(source).path)
    elif len(scheme) > 1:                 # one letter: a Windows drive, kept as a path
        raise MediaError(where, f"unsupported media URL scheme {scheme!r} (use a local path, a "
                                "data URI or an HTTP(S) URL)")
    return _local(Path(source), where, limits)


def _data_uri(source: str, where: str, limits: SourceLimits) -> bytes:
    header, comma, payload = source.partition(",")
    if not comma or not header.endswith(";base64"):
        raise MediaError(where, "a data URI must be `data:<type>;base64,<data>`")
    # Base64 is 4/3 of the bytes: refuse before decoding a payload far over the limit.
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise MediaError(where, f"media is larger than the {limits.max_bytes} byte limit")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(where, "the data URI's base64 payload is invalid") from None
    return _sized(data, where, limits)


def _local(path: Path, where: str, limits: SourceLimits) -> bytes:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise MediaError(where, f"media file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise MediaError(where, f"cannot read media file {str(path)!r}: {exc.strerror}") from None
    if size > limits.max_bytes:
        raise MediaError(where, f"media file {str(path)!r} has {size} bytes, over the "
                                f"{limits.max_bytes} byte limit")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise MediaError(where, f"cannot read media file {str(path)!r}: {exc.strerror}") from None


def _remote(url: str, where: str, limits: SourceLimits) -> bytes:
    if not limits.allow_remote:
        raise MediaError(where, "remote media URLs are off; start with --allow-remote-media to "
                                "fetch them, or send the media as a base64 data URI")
    try:
        with urllib.request.urlopen(url, timeout=limits.timeout_s) as response:
            data = response.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise MediaError(where, f"cannot fetch {url!r}: {exc}") from None
    return _sized(data, where, limits)


def _sized(data: bytes, where: str, limits: SourceLimits) -> bytes:
    if len(data) > limits.max_bytes:
        raise MediaError(where, f"media is larger than the {limits.max_bytes} byte limit")
    if not data:
        raise MediaError(where, "media is empty")
    return data
