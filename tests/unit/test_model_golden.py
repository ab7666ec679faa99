"""The NumPy reference against Hugging Face transformers' outputs (tests/data/golden/).

The golden data was made by tools/make_golden.py (its docstring says how and where). Each family
directory holds an HF checkpoint (bf16, real-release layout, with an MTP head) and the oracle's
float32 outputs. Two loading paths are checked:

- the project's converter and reader (`tools.convert` -> `.infernix` ->
  `NumpyRunner.from_artifact`), the path the product uses;
- a direct read of the safetensors file (independent of the converter, so a converter bug and a
  model bug are told apart); weights.py then handles the per-expert / fused-Next layouts.

Tolerance: relative error max|ours - oracle| / max|oracle| <= 1e-5, in float32.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from runtime.model.config import LINEAR_ATTENTION, ModelConfig
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.runner import PAGE_SIZE, DecodeItem, PrefillChunk

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
FAMILIES = ("dense", "moe", "next")
TOLERANCE = 1e-5


def relative_error(ours: np.ndarray, oracle: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - oracle)) / np.max(np.abs(oracle)))


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A minimal safetensors reader (F32 and BF16), so this test needs no torch."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    payload = memoryview(data)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, stop = info["data_offsets"]
        raw = payload[start:stop]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            array = bits.view(np.float32)
        elif info["dtype"] == "F32":
            array = np.frombuffer(raw, dtype="<f4").copy()
        else:
            raise ValueError(f"{name}: unexpected dtype {info['dtype']}")
        tensors[name] = array.reshape(info["shape"])
    return tensors


def load_hf_dir(directory: Path) -> tuple[ModelConfig, dict, dict]:
    """(config, canonical text weights, canonical MTP weights) straight from an HF directory."""
    config = ModelConfig.from_dict(json.loads((directory / "config.json").read_text()))
    text, mtp = {}, {}
    for name, array in read_safetensors(directory / "model.safetensors").items():
        if name.startswith("mtp."):
            mtp[name[len("mtp."):]] = array
        elif name.startswith("model.language_model."):
            text[name[len("model.language_model."):]] = array
        elif name.startswith("model."):
            text[name[len("model."):]] = array
        else:
            text[name] = array
    return config, text, mtp


def check_golden(runner: NumpyRunner, golden: dict[str, np.ndarray]) -> dict[str, float]:
    """Run the oracle's scenario on `runner`; returns the relative error of every quantity."""
    ids = golden["ids"].tolist()
    steps = len(ids)
    config = runner.config
    pages = list(range(-(-steps // PAGE_SIZE)))
    errors = {}

    runner.reset_slot(0)
    full = runner.prefill_with_hidden(PrefillChunk(0, ids, 0, pages, all_logits=True))
    errors["logits"] = relative_error(full.logits, golden["logits"])
    errors["hidden"] = relative_error(full.hidden, golden["hidden"])
    mtp = runner.mtp_prefill(full.hidden[:-1], ids[1:], 0, pages)
    errors["mtp_logits"] = relative_error(mtp.logits, golden["mtp_logits"])

    # Prefix, then states, then one cached decode step (in another slot and other pages).
    pages_b = [p + len(pages) for p in pages]
    runner.reset_slot(1)
    runner.prefill(PrefillChunk(1, ids[:-1], 0, pages_b))
    for layer, kind in enumerate(config.layer_types):
        if kind == LINEAR_ATTENTION:
            index = config.linear_layers.index(layer)
            errors[f"conv_{layer}"] = relative_error(runner.conv_states[index, 1],
                                                     golden[f"prefix_conv_{layer}"])
            errors[f"recurrent_{layer}"] = relative_error(runner.recurrent_states[index, 1],
                                                          golden[f"prefix_recurrent_{layer}"])
        else:
            index = config.attention_layers.index(layer)
            rows = [(pages_b[p // PAGE_SIZE], p % PAGE_SIZE) for p in range(steps - 1)]
            keys = np.stack([runner.key_pages[index, page, row] for page, row in rows])
            values = np.stack([runner.value_pages[index, page, row] for page, row in rows])
            errors[f"key_{layer}"] = relative_error(keys, golden[f"prefix_key_{layer}"])
            errors[f"value_{layer}"] = relative_error(values, golden[f"prefix_value_{layer}"])
    step = runner.decode([DecodeItem(1, ids[-1], steps - 1, pages_b)])
    errors["decode_logits"] = relative_error(step[0], golden["decode_logits"])
    return errors


def _golden(family: str) -> dict[str, np.ndarray]:
    path = GOLDEN / family / "golden.npz"
    if not path.exists():
        pytest.skip(f"no golden data at {path}")
    with np.load(path) as data:
        return dict(data)


def write_small_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json over the tiny vocabulary, so the converter does not build the
    real Qwen one (seconds) for a model whose ids are random anyway."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(vocab_size)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> path of the `.infernix` the project's converter makes (bf16 recipe)."""
    convert = pytest.importorskip("tools.convert")
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            _golden(family)
            work = tmp_path_factory.mktemp(family)
            source = work / "hf"
            source.mkdir()
            for name in ("config.json", "model.safetensors"):
                shutil.copy(GOLDEN / family / name, source / name)
            vocab = ModelConfig.from_dict(json.loads((source / "config.json").read_text()))
            write_small_tokenizer(source, vocab.vocab_size)
            made[family] = convert.convert(source, work / f"{family}.infernix",
                                           convert.Recipe("bf16"), log=None)
        return made[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_through_converter_and_reader(family, converted):
    """The product path: HF checkpoint -> tools.convert -> .infernix -> NumpyRunner."""
    golden = _golden(family)
    runner = NumpyRunner.from_artifact(converted(family), num_pages=4, num_slots=2, mtp=True)
    assert runner.config.family == family
    errors = check_golden(runner, golden)
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"{family}: relative errors above {TOLERANCE}: {bad}"


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_direct_read(family):
    golden = _golden(family)
    config, text, mtp = load_hf_dir(GOLDEN / family)
    assert config.family == family
    pages = 2 * -(-len(golden["ids"]) // PAGE_SIZE)
    runner = NumpyRunner(config, text, num_pages=pages, num_slots=2, mtp_weights=mtp)
    errors = check_golden(runner, golden)
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"{family}: relative errors above {TOLERANCE}: {bad}"


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_in_float64(family):
    """The same in float64: the oracle's own float32 rounding is then the only difference."""
    golden = _golden(family)
    config, text, mtp = load_hf_dir(GOLDEN / family)
    runner = NumpyRunner(config, text, num_pages=4, num_slots=2, dtype=np.float64,
                         mtp_weights=mtp)
    errors = check_golden(runner, golden)
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"{family}: relative errors above {TOLERANCE}: {bad}"


@pytest.mark.parametrize("name,change", [
    ("layers.0.linear_attn.norm.weight", lambda w: w - 1.0),    # gated norm read as 1 + w
    ("layers.2.self_attn.q_norm.weight", lambda w: w + 1.0),    # zero-centred norm read as w
    ("layers.3.linear_attn.dt_bias", lambda w: w * 0.0),
])
def test_golden_data_catches_convention_mixups(name, change):
    """The oracle's perturbed norms and gates make each of these mistakes fail the comparison."""
    golden = _golden("dense")
    config, text, mtp = load_hf_dir(GOLDEN / "dense")
    text[name] = change(text[name])
    runner = NumpyRunner(config, text, num_pages=4, num_slots=2, mtp_weights=mtp)
    assert check_golden(runner, golden)["logits"] > 100 * TOLERANCE
