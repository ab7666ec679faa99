"""The `.infernix` container: writer/reader round trips, layout rules, shards, components and
every way a damaged file must fail at open (runtime/artifact)."""

import json
import struct
import zlib

import numpy as np
import pytest

from runtime.artifact import ArtifactError, ArtifactWriter, open_artifact, spec
from runtime.artifact.__main__ import main as artifact_main
from runtime.artifact.writer import shard_name

RNG = np.random.default_rng(0)
VALUES = {
    "embed_tokens.weight": (RNG.standard_normal((40, 32)), "bf16", 1),
    "layers.0.linear_attn.A_log": (RNG.standard_normal(8), "fp32", 1),
    "layers.0.mlp.down_proj.weight": (RNG.standard_normal((32, 160)), "fp8_e4m3", 1),
    "layers.0.mlp.experts.gate_up_proj": (RNG.standard_normal((3, 64, 32)), "nvfp4", 2),
    "norm.weight": (RNG.standard_normal(32), "bf16", 1),
}
RESOURCES = {"tokenizer.json": b'{"model": {}}', "chat_template.jinja": "{{ héllo }}".encode()}


def write_sample(path, max_file_bytes=None):
    with ArtifactWriter(path, max_file_bytes=max_file_bytes, metadata={"name": "sample"}) as w:
        w.add_component("text", {"hidden_size": 32, "layer_types": ["linear_attention"]},
                        RESOURCES)
        w.add_component("mtp", {"num_hidden_layers": 1})
        for name, (values, fmt, groups) in VALUES.items():
            w.add_tensor("text", name, values, fmt, groups)
        w.add_tensor("mtp", "fc.weight", RNG.standard_normal((32, 64)), "bf16")
        w.add_tensor("mtp", "norm.weight", RNG.standard_normal(32), "fp32")
    return path


@pytest.fixture
def sample(tmp_path):
    return write_sample(tmp_path / "m.infernix")


@pytest.fixture
def sharded(tmp_path):
    path = write_sample(tmp_path / "s.infernix", max_file_bytes=3000)
    return path


def read_directory(path):
    raw = path.read_bytes()
    header = spec.Header.unpack(raw, str(path))
    return header, json.loads(raw[spec.HEADER_BYTES:spec.HEADER_BYTES + header.json_bytes])


def rewrite_directory(path, mutate):
    """Apply `mutate` to the JSON directory and write it back with a valid header checksum, so
    the reader's structural checks (not the checksum) must catch the damage."""
    header, root = read_directory(path)
    mutate(root)
    directory = json.dumps(root).encode()
    assert spec.HEADER_BYTES + len(directory) <= header.payload_offset
    fields = dict(header.__dict__, json_crc32=zlib.crc32(directory), json_bytes=len(directory))
    with open(path, "r+b") as handle:
        handle.write(spec.Header(**fields).pack())
        handle.write(directory)


def patch_header(path, **changes):
    header = spec.Header.unpack(path.read_bytes()[:spec.HEADER_BYTES], str(path))
    with open(path, "r+b") as handle:
        handle.write(spec.Header(**dict(header.__dict__, **changes)).pack())


# ---- round trip ------------------------------------------------------------------------------

def test_round_trip_values_configs_resources(sample):
    with open_artifact(sample) as art:
        assert art.component_names == ("text", "mtp")
        text = art.component("text")
        assert text.config == {"hidden_size": 32, "layer_types": ["linear_attention"]}
        assert text.resources == RESOURCES
        assert text.tensor_names() == tuple(VALUES)
        assert art.metadata == {"name": "sample"}
        for name, (values, fmt, groups) in VALUES.items():
            entry = text.entry(name)
            assert (entry.format, entry.shape, entry.row_groups) == (fmt, values.shape, groups)
            expected = spec.decode(spec.encode(values, fmt, groups), fmt, groups)
            assert np.array_equal(text.f32(name), expected)
        assert np.array_equal(text.raw("embed_tokens.weight"),
                              spec.encode(VALUES["embed_tokens.weight"][0], "bf16")["data"])
        nv = text.entry("layers.0.mlp.experts.gate_up_proj")
        assert {k: p.shape for k, p in nv.parts.items()} == {
            "data": (3, 64, 16), "scale": (3, 64, 2), "global_scale": (3, 2)}
        assert "fp32 global" in nv.scale_layout
        art.verify()


def test_raw_is_zero_copy_read_only_and_aligned(sample):
    header, _ = read_directory(sample)
    assert header.payload_offset % spec.PAYLOAD_ALIGN == 0
    with open_artifact(sample) as art:
        text = art.component("text")
        for name in text.tensor_names():
            for part_name, part in text.entry(name).parts.items():
                view = text.raw(name, part_name)
                assert part.offset % spec.TENSOR_ALIGN == 0
                assert not view.flags.owndata and not view.flags.writeable
                assert view.dtype == part.dtype and view.shape == part.shape
        with pytest.raises(ArtifactError, match="has no part 'scale'"):
            text.raw("norm.weight", "scale")
        with pytest.raises(ArtifactError, match="has no tensor 'nope'"):
            text.entry("nope")


def test_streaming_producers_run_once_in_order_and_holes_stay_zero(tmp_path):
    calls = []

    def producer(i):
        def produce():
            calls.append(i)
            return {"data": np.full((4, 8), i, dtype=np.float32)}
        return produce

    with ArtifactWriter(tmp_path / "s.infernix") as w:
        w.add_component("text", {})
        for i in range(3):
            w.add_encoded("text", f"t{i}", "fp32", (4, 8), producer(i))
        w.add_encoded("text", "hole", "bf16", (1000, 1000), None)
        assert calls == []
    assert calls == [0, 1, 2]
    with open_artifact(tmp_path / "s.infernix") as art:
        text = art.component("text")
        assert [text.raw(f"t{i}")[0, 0] for i in range(3)] == [0, 1, 2]
        assert not text.raw("hole").any() and text.entry("hole").parts["data"].crc32 is None
        art.verify()


def test_writer_rejects_bad_input(tmp_path):
    w = ArtifactWriter(tmp_path / "x.infernix")
    with pytest.raises(ValueError, match="add component 'text' first"):
        w.add_tensor("text", "a", np.ones(3))
    w.add_component("text", {})
    with pytest.raises(ValueError, match="added twice"):
        w.add_component("text", {})
    w.add_tensor("text", "a", np.ones(3))
    with pytest.raises(ValueError, match="text/a added twice"):
        w.add_tensor("text", "a", np.ones(3))
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        w.add_encoded("text", "b", "int4", (3,), None)
    with pytest.raises(ValueError, match="multiple of 16"):
        w.add_encoded("text", "b", "nvfp4", (4, 24), None)
    with pytest.raises(ValueError, match="part 'data' is float64"):
        w.add_encoded("text", "b", "fp32", (3,), {"data": np.ones(3)})
    with pytest.raises(ValueError, match="parts"):
        w.add_encoded("text", "b", "fp8_e4m3", (3, 3), {"data": np.ones((3, 3), np.uint8)})
    with pytest.raises(ValueError, match="NaN|JSON|Out of range"):
        w.add_component("mtp", {"x": float("nan")})
    empty = ArtifactWriter(tmp_path / "y.infernix")
    empty.add_component("mtp", {})
    with pytest.raises(ValueError, match="needs a 'text' component"):
        empty.finish()


def test_failed_producer_leaves_no_file(tmp_path):
    def boom():
        raise RuntimeError("source went away")
    w = ArtifactWriter(tmp_path / "x.infernix")
    w.add_component("text", {})
    w.add_encoded("text", "a", "fp32", (2,), boom)
    with pytest.raises(RuntimeError, match="source went away"):
        w.finish()
    assert list(tmp_path.iterdir()) == []


# ---- shards and components -------------------------------------------------------------------

def test_shards_round_trip_and_tensors_stay_whole(sharded):
    with open_artifact(sharded) as art:
        assert len(art.files) > 2
        assert art.files[1].name == shard_name(sharded.name, 1)
        text = art.component("text")
        for name, (values, fmt, groups) in VALUES.items():
            entry = text.entry(name)
            assert len({p.file for p in entry.parts.values()}) == 1
            assert np.array_equal(text.f32(name),
                                  spec.decode(spec.encode(values, fmt, groups), fmt, groups))
        art.verify()


def mtp_only_files(path):
    with open_artifact(path) as art:
        used = lambda c: {p.file for n in art.component(c).tensor_names()
                          for p in art.component(c).entry(n).parts.values()}
        return sorted(used("mtp") - used("text")), art.files


def test_disabled_component_is_never_read(sharded):
    only_mtp, files = mtp_only_files(sharded)
    assert only_mtp, "the sample should put MTP tensors in a shard of their own"
    for index in only_mtp:
        files[index].unlink()
    with open_artifact(sharded, components=("text",)) as art:
        assert art.component_names == ("text",)
        text = art.component("text")
        for name in text.tensor_names():
            text.f32(name)
        with pytest.raises(ArtifactError, match="'mtp' is not enabled"):
            art.component("mtp")
        with pytest.raises(ArtifactError, match="'vision' is not present"):
            art.component("vision")
    with pytest.raises(ArtifactError, match=f"{files[only_mtp[0]].name}.*cannot be opened"):
        open_artifact(sharded)


def test_unknown_component_requested(sample):
    with pytest.raises(ArtifactError, match=r"m\.infernix: component 'vision' is not present"):
        open_artifact(sample, components=("text", "vision"))


@pytest.mark.parametrize("damage, message", [
    ("other_artifact", "belongs to a different artifact"),
    ("swapped", "expected shard 1"),
    ("truncated", "truncated"),
    ("missing", "cannot be opened"),
])
def test_mismatched_shards_fail_at_open(sharded, tmp_path, damage, message):
    shard1 = sharded.with_name(shard_name(sharded.name, 1))
    if damage == "other_artifact":
        (tmp_path / "other").mkdir()
        other = write_sample(tmp_path / "other" / sharded.name, max_file_bytes=3000)
        shard1.write_bytes(other.with_name(shard1.name).read_bytes())
    elif damage == "swapped":
        shard2 = sharded.with_name(shard_name(sharded.name, 2))
        one, two = shard1.read_bytes(), shard2.read_bytes()
        shard1.write_bytes(two)
        shard2.write_bytes(one)
    elif damage == "truncated":
        shard1.write_bytes(shard1.read_bytes()[:-100])
    else:
        shard1.unlink()
    with pytest.raises(ArtifactError, match=f"{shard1.name}.*{message}"):
        open_artifact(sharded)


def test_opening_a_shard_directly_says_so(sharded):
    with pytest.raises(ArtifactError, match="this is shard 1 .* open the main file"):
        open_artifact(sharded.with_name(shard_name(sharded.name, 1)))


# ---- damaged files ---------------------------------------------------------------------------

def test_missing_empty_and_foreign_files(tmp_path):
    with pytest.raises(ArtifactError, match="nope.infernix: cannot open"):
        open_artifact(tmp_path / "nope.infernix")
    (tmp_path / "empty.infernix").write_bytes(b"")
    with pytest.raises(ArtifactError, match="empty.infernix: truncated: 0 bytes"):
        open_artifact(tmp_path / "empty.infernix")
    (tmp_path / "x.infernix").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ArtifactError, match="x.infernix: not an .infernix file"):
        open_artifact(tmp_path / "x.infernix")


def test_wrong_version(sample):
    patch_header(sample, version=7)
    with pytest.raises(ArtifactError, match="unsupported format version 7 .*supports version 1"):
        open_artifact(sample)


@pytest.mark.parametrize("cut, message", [
    (40, "truncated: 40 bytes"),
    (spec.HEADER_BYTES + 10, "truncated inside the directory"),
    (-1, "truncated: .* expected"),
])
def test_truncated_file(sample, cut, message):
    raw = sample.read_bytes()
    sample.write_bytes(raw[:cut])
    with pytest.raises(ArtifactError, match=f"m.infernix: {message}"):
        open_artifact(sample)


def test_trailing_bytes(sample):
    with open(sample, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ArtifactError, match="has trailing bytes"):
        open_artifact(sample)


def test_corrupt_directory_checksum(sample):
    raw = bytearray(sample.read_bytes())
    raw[spec.HEADER_BYTES + 20] ^= 0x01
    sample.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="m.infernix: directory checksum mismatch"):
        open_artifact(sample)


def test_directory_not_json(sample):
    header, _ = read_directory(sample)
    junk = b"{not json" + b" " * (header.json_bytes - 9)
    with open(sample, "r+b") as handle:
        handle.seek(spec.HEADER_BYTES)
        handle.write(junk)
    patch_header(sample, json_crc32=zlib.crc32(junk))
    with pytest.raises(ArtifactError, match="directory is not valid JSON"):
        open_artifact(sample)


def part(root, tensor="norm.weight", name="data", component="text"):
    return root["components"][component]["tensors"][tensor]["parts"][name]


@pytest.mark.parametrize("mutate, message", [
    (lambda r: part(r).update(offset=r["files"][0]["payload_bytes"]), "lie outside the payload"),
    (lambda r: part(r).update(offset=part(r)["offset"] + 2), "not 256-byte aligned"),
    (lambda r: part(r).update(offset=part(r, "embed_tokens.weight")["offset"]), "overlap"),
    (lambda r: part(r).update(nbytes=part(r)["nbytes"] - 2), "needs 64"),
    (lambda r: part(r).update(file=5), "bad placement"),
    (lambda r: part(r).update(crc32=12), "malformed checksum"),
    (lambda r: r["components"]["text"]["tensors"]["norm.weight"].update(format="int3"),
     "unknown format 'int3'"),
    (lambda r: part(r, "layers.0.mlp.down_proj.weight", "scale").update(dtype="float16"),
     "stored as float16"),
    (lambda r: r["components"]["text"]["tensors"]["layers.0.mlp.down_proj.weight"]["parts"]
     .pop("scale"), "do not match format fp8_e4m3"),
    (lambda r: r["components"]["text"]["tensors"]["norm.weight"].update(shape=[-1]),
     "malformed entry"),
    (lambda r: r["components"].pop("text"), "no 'text' component"),
    (lambda r: r["components"]["text"].pop("config"), "has no config"),
    (lambda r: r.update(version=2), "directory version 2 differs"),
    (lambda r: r.update(artifact_id="00" * 16), "artifact id differs"),
    (lambda r: r["files"].append({"name": "x", "payload_bytes": 0}), "file table lists 2"),
    (lambda r: r["files"][0].update(name="../etc"), "file table entry 0 is malformed"),
    (lambda r: r["files"][0].update(payload_bytes=1), "the directory says 1"),
])
def test_inconsistent_directory(sample, mutate, message):
    rewrite_directory(sample, mutate)
    with pytest.raises(ArtifactError, match=f"m.infernix: .*{message}"):
        open_artifact(sample)


def test_corrupt_payload_found_by_verify(sample):
    with open_artifact(sample) as art:
        offset = art.component("text").entry("layers.0.linear_attn.A_log").parts["data"].offset
    raw = bytearray(sample.read_bytes())
    raw[offset] ^= 0xFF
    sample.write_bytes(bytes(raw))
    with open_artifact(sample) as art:        # opening never reads the payload
        with pytest.raises(ArtifactError, match="tensor layers.0.linear_attn.A_log part data: "
                                                "checksum"):
            art.verify()


def test_close_with_live_views(sample):
    art = open_artifact(sample)
    view = art.component("text").raw("norm.weight")
    art.close()
    assert view.shape == (32,)


def test_cli_info_and_verify(sample, capsys):
    assert artifact_main(["verify", str(sample), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "text: 5 tensors" in out and "checksums match" in out and "nvfp4 [3, 64, 32]" in out
    sample.write_bytes(b"junk")
    assert artifact_main(["info", str(sample)]) == 1
    assert "error:" in capsys.readouterr().err


def test_header_layout_is_64_bytes():
    assert spec.HEADER_BYTES == 64 and struct.calcsize("<8sIIIIQQQ16s") == 64
