"""Reader and writer of `.infernix` artifacts: a small header, a JSON directory and an aligned
payload, memory-mapped and handed out as zero-copy numpy views (format in docs/artifact.md)."""

from runtime.artifact.reader import Artifact, Component, PartEntry, TensorEntry, open_artifact
from runtime.artifact.spec import FORMATS, ArtifactError
from runtime.artifact.writer import ArtifactWriter

__all__ = ["open_artifact", "Artifact", "Component", "TensorEntry", "PartEntry",
           "ArtifactWriter", "ArtifactError", "FORMATS"]
