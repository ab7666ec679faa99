"""Media input for the vision tower: where an image or video comes from, how it is decoded, and
the model's preprocessing (numpy and `av` only; no model, text or engine code).

- `sources`: a content part's image source (local path, base64 data URI, HTTP(S) URL behind
  `--allow-remote-media`) -> bytes, with size and time limits; `MediaError` names the part.
- `image`: bytes -> RGB uint8 pixels (`av` decodes PNG, JPEG, WebP, GIF as one frame; alpha is
  dropped), the smart resize, the resampler, normalisation and the patch layout the tower reads.
- `video`: bytes -> the frames the model's rule samples (`av`), the video budget, odd counts
  padded, frame groups with their timestamps, in the image's patch layout.
- `placement`: the parts of a chat decoded in order, each video's frame-group blocks, and the pads
  widened to `MediaSpan`s.
"""
