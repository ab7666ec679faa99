"""pyproject.toml: the license in the SPDX string form (the table form is deprecated and stops
building in 2027), and a `dev` extra that admits the SDK majors clients install today."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def load() -> dict:
    with PYPROJECT.open("rb") as file:
        return tomllib.load(file)


def test_license_is_an_spdx_string_with_a_setuptools_that_reads_it():
    data = load()
    assert data["project"]["license"] == "Apache-2.0"
    setuptools = next(Requirement(r) for r in data["build-system"]["requires"]
                      if r.startswith("setuptools"))
    # setuptools 77 is the first to take `license` as an SPDX expression.
    assert not setuptools.specifier.contains("76.0") and setuptools.specifier.contains("77.0")


def test_dev_extra_admits_the_current_sdk_majors_and_the_installed_ones():
    dev = {Requirement(r).name: Requirement(r) for r in
           load()["project"]["optional-dependencies"]["dev"]}
    assert dev["openai"].specifier.contains("3.57.0")
    assert dev["anthropic"].specifier.contains("2.15.0")
    for name in ("openai", "anthropic"):
        installed = Version(importlib.metadata.version(name))
        assert dev[name].specifier.contains(installed), (name, installed)
