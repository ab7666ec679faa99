"""Media input for the vision tower: where an image comes from, how it is decoded, and the
model's preprocessing (numpy and `av` only; no model, text or engine code).

- `sources`: a content part's image source (local path, base64 data URI, HTTP(S) URL behind
  `--allow-remote-media`) -> bytes, with size and time limits; `MediaError` names the part.
- `image`: bytes -> RGB uint8 pixels (`av` decodes PNG, JPEG, WebP, GIF as one frame; alpha is
  dropped), the smart resize, the resampler, normalisation and the patch layout the tower reads.
"""
