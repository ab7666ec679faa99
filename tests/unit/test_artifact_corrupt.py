"""Corrupt and hostile artifacts never hang the loader or load silently (issue 23): a FIFO is
refused, header fields beyond the file are named, a flipped byte in a resource fails at load,
and non-finite logits are named as such by the sampler."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from runtime.artifact import ArtifactError, open_artifact
from runtime.artifact import spec
from runtime.engine.api import SamplingParams
from runtime.engine.sampler import DeadEndError, SamplerState, sample_token
from runtime.model.sampling import pack_mask
from tests.unit.test_artifact import RESOURCES, patch_header, read_directory, write_sample


@pytest.fixture
def sample(tmp_path):
    return write_sample(tmp_path / "m.infernix")


def open_in_thread(path, timeout: float = 5.0):
    """open_artifact on a thread: (the exception it raised or None, whether it finished)."""
    outcome = {}

    def run():
        try:
            open_artifact(path).close()
            outcome["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome.get("error"), not thread.is_alive()


def test_a_fifo_named_like_an_artifact_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "model.infernix"
    os.mkfifo(fifo)
    error, finished = open_in_thread(fifo)
    assert finished
    assert isinstance(error, ArtifactError) and "not a regular file" in str(error)


def test_a_directory_is_refused(tmp_path):
    directory = tmp_path / "dir.infernix"
    directory.mkdir()
    error, finished = open_in_thread(directory)
    assert finished and isinstance(error, ArtifactError)
    assert str(directory) in str(error)


@pytest.mark.parametrize("field, value, name", [
    ("json_bytes", 2 ** 36, "directory length"),
    ("json_bytes", 2 ** 63, "directory length"),
    ("payload_offset", 2 ** 63, "payload offset"),
    ("payload_bytes", 2 ** 62, "payload length"),
])
def test_header_fields_beyond_the_file_are_named(sample, field, value, name):
    patch_header(sample, **{field: value})
    with pytest.raises(ArtifactError) as caught:
        open_artifact(sample)
    message = str(caught.value)
    assert f"header field {name} is {value}" in message
    assert str(sample.stat().st_size) in message


@pytest.mark.parametrize("resource", sorted(RESOURCES))
def test_a_flipped_byte_in_a_resource_fails_at_load(sample, resource):
    header, root = read_directory(sample)
    placement = root["components"]["text"]["resources"][resource]
    position = header.payload_offset + placement["offset"]
    with open(sample, "r+b") as handle:
        handle.seek(position)
        byte = handle.read(1)
        handle.seek(position)
        handle.write(bytes([byte[0] ^ 0x01]))
    with open_artifact(sample) as artifact:
        with pytest.raises(ArtifactError) as caught:
            artifact.component("text").resources
    assert f"resource {resource!r}" in str(caught.value)
    assert "corrupt" in str(caught.value)


def test_an_intact_artifact_still_loads_its_resources(sample):
    with open_artifact(sample) as artifact:
        assert artifact.component("text").resources == RESOURCES
    assert spec.HEADER_BYTES < sample.stat().st_size


def test_nan_logits_are_named_not_blamed_on_the_constraint():
    state = SamplerState(SamplingParams(temperature=0.0))
    logits = np.full(64, np.nan, dtype=np.float32)
    with pytest.raises(DeadEndError, match="NaN or infinite logits"):
        sample_token(logits, state)
    allowed = np.zeros(64, dtype=bool)
    allowed[3] = True
    with pytest.raises(DeadEndError, match="NaN or infinite logits"):
        sample_token(logits, state, pack_mask(allowed))
    with pytest.raises(DeadEndError, match="the output constraint allows no token"):
        sample_token(np.zeros(64, np.float32), state, pack_mask(np.zeros(64, dtype=bool)))
