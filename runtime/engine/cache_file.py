"""The prefix cache's file tier (`--prefix-cache-file`): shared snapshots and the KV blocks
they need, kept across restarts.

Format: a NumPy `.npz` archive (a zip with a CRC per member, so corruption and truncation are
detected on read) holding `manifest` (UTF-8 JSON: format version, fingerprint, one record per
snapshot) and the arrays: `s{i}_{j}` (snapshot i's state arrays), `t{i}_{j}` (its tail page),
`b{k}_{j}` (block k's K/V). The fingerprint names everything the arrays depend on (model,
artifact, runner build and dtype, KV format, state and page sizes); a file whose fingerprint or
version differs, or that cannot be read, is ignored with one warning that says why, and is
replaced at the next save. Writes go to a temporary file in the same directory, then
`os.replace`, so a crash mid-write leaves the old file intact.

Reading puts everything in the host tier (as far as `--host-context-mib` allows, deepest
snapshots first); resuming from it then costs host-to-device copies only. Both calls run on
the engine thread (saving reads device snapshots and pages through the runner).
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from typing import Optional

import numpy as np

from runtime.engine.cache_ops import HostCopy
from runtime.engine.prefix_cache import PrefixCache
from runtime.model.runner import HostArrays, ModelRunner

FORMAT_VERSION = 1


def save_cache_file(path: str, fingerprint: str, cache: PrefixCache, runner: ModelRunner) -> int:
    """Write every shared snapshot and its blocks; returns the bytes written."""
    arrays: dict[str, np.ndarray] = {}
    records = []
    block_index: dict[bytes, int] = {}
    for i, entry in enumerate(cache.shared_entries()):
        # The file needs the bytes: here (only) the host waits for copies still in flight.
        state = (runner.save_slot(entry.slot) if entry.slot is not None else entry.state.data).wait()
        _put(arrays, f"s{i}", state)
        tail = entry.tail_copy.data.wait() if entry.tail_copy is not None else ()
        _put(arrays, f"t{i}", tail)
        for digest in entry.chain:
            if digest in block_index:
                continue
            page = cache.blocks.lookup(digest)
            data = (runner.read_pages([page]) if page is not None else cache.host_block(digest).data).wait()
            block_index[digest] = len(block_index)
            _put(arrays, f"b{block_index[digest]}", data)
        records.append({"position": entry.position, "hits": entry.hits,
                        "chain": [block_index[d] for d in entry.chain],
                        "tail": list(entry.tail), "state_parts": len(state),
                        "tail_parts": len(tail)})
    manifest = {"version": FORMAT_VERSION, "fingerprint": fingerprint, "snapshots": records,
                "blocks": [d.hex() for d in sorted(block_index, key=block_index.get)],
                "block_parts": {str(k): _parts(arrays, f"b{k}") for k in block_index.values()}}
    arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".prefix-cache-", dir=directory)
    try:
        with os.fdopen(handle, "wb") as out:
            np.savez(out, **arrays)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return os.path.getsize(path)


def load_cache_file(path: str, fingerprint: str, cache: PrefixCache, warn) -> int:
    """Read a file written by `save_cache_file` into the host tier; returns the snapshots
    restored. A missing file restores nothing silently; an unusable one calls `warn(reason)`
    once and restores nothing."""
    if not os.path.exists(path):
        return 0
    try:
        with np.load(path, allow_pickle=False) as archive:
            manifest = json.loads(bytes(archive["manifest"]).decode())
            reason = _mismatch(manifest, fingerprint)
            if reason is not None:
                warn(f"prefix cache file {path} ignored: {reason}")
                return 0
            return _restore(archive, manifest, cache)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
        warn(f"prefix cache file {path} ignored: unreadable ({type(exc).__name__}: {exc})")
        return 0


def _mismatch(manifest: dict, fingerprint: str) -> Optional[str]:
    if manifest.get("version") != FORMAT_VERSION:
        return f"format version {manifest.get('version')!r}, this build reads {FORMAT_VERSION}"
    if manifest.get("fingerprint") != fingerprint:
        return (f"written for {manifest.get('fingerprint')!r}, this server is {fingerprint!r} "
                f"(another model, artifact, runner build or KV format)")
    return None


def _restore(archive, manifest: dict, cache: PrefixCache) -> int:
    digests = [bytes.fromhex(d) for d in manifest["blocks"]]
    block_parts = manifest["block_parts"]
    restored = 0
    # Deepest first: when the host budget runs out, the longest prefixes are the ones kept.
    order = sorted(range(len(manifest["snapshots"])),
                   key=lambda i: -manifest["snapshots"][i]["position"])
    loaded = []
    for i in order:
        record = manifest["snapshots"][i]
        state = _get(archive, f"s{i}", record["state_parts"])
        tail = _get(archive, f"t{i}", record["tail_parts"]) if record["tail_parts"] else None
        blocks = {digests[k]: HostCopy.of(_get(archive, f"b{k}", block_parts[str(k)]))
                  for k in record["chain"]}
        loaded.append((record, state, tail, blocks))
    # Every array is read (and CRC-checked) before anything enters the cache.
    for record, state, tail, blocks in loaded:
        if cache.restore_entry(int(record["position"]), tuple(digests[k] for k in record["chain"]),
                               tuple(int(t) for t in record["tail"]), HostCopy.of(state),
                               None if tail is None else HostCopy.of(tail), blocks):
            restored += 1
    return restored


def _put(arrays: dict, prefix: str, data: HostArrays) -> None:
    for j, part in enumerate(data):
        arrays[f"{prefix}_{j}"] = part


def _parts(arrays: dict, prefix: str) -> int:
    return sum(1 for name in arrays if name.startswith(prefix + "_"))


def _get(archive, prefix: str, parts: int) -> HostArrays:
    return tuple(archive[f"{prefix}_{j}"] for j in range(parts))

