"""Package conventions a user's tools rely on: PEP 561's py.typed marker ships in the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

import lrmoe

ROOT = Path(__file__).resolve().parents[1]


def test_py_typed_marker_is_in_the_package_and_its_package_data():
    """Without the marker (and package data that puts it in the wheel), mypy and pyright ignore lrmoe's inline
    annotations and type every import as Any."""
    assert (Path(lrmoe.__file__).parent / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["lrmoe"]
