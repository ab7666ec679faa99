"""Inspect an artifact: `python -m runtime.artifact info FILE [--tensors]` prints its
components, configs' key sizes and tensor formats; `verify FILE` also reads every byte and checks
the stored checksums (opening alone never reads the payload)."""

from __future__ import annotations

import argparse
import collections
import sys
import time

from runtime.artifact import ArtifactError, open_artifact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.artifact", description=__doc__)
    parser.add_argument("command", choices=("info", "verify"))
    parser.add_argument("file")
    parser.add_argument("--tensors", action="store_true", help="list every tensor")
    args = parser.parse_args(argv)
    try:
        started = time.perf_counter()
        artifact = open_artifact(args.file)
        opened = time.perf_counter() - started
        print(f"{args.file}: {len(artifact.files)} file(s), opened in {opened * 1e3:.1f} ms")
        for name in artifact.component_names:
            component = artifact.component(name)
            entries = [component.entry(t) for t in component.tensor_names()]
            by_format = collections.Counter(e.format for e in entries)
            size = sum(e.nbytes for e in entries) / 2 ** 20
            print(f"  {name}: {len(entries)} tensors, {size:.1f} MiB ("
                  + ", ".join(f"{fmt} {count}" for fmt, count in sorted(by_format.items()))
                  + f"); resources: {', '.join(component.resources) or 'none'}")
            if args.tensors:
                for e in entries:
                    print(f"    {e.name} {e.format} {list(e.shape)}")
        if args.command == "verify":
            started = time.perf_counter()
            artifact.verify()
            print(f"checksums match ({time.perf_counter() - started:.1f} s)")
        artifact.close()
    except ArtifactError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
