"""Package conventions a user's tools rely on: PEP 561's py.typed marker ships in the wheel; README's test command
is the one CI runs."""

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


def test_readme_test_command_is_what_ci_runs():
    """README promises that .ci/run runs its install-and-test command: the same line, flags included (the xdist
    flags need the [test] extra's pytest-xdist version)."""
    readme = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
              if line.strip().startswith("pip install") and "pytest" in line]
    assert len(readme) == 1, readme
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if "pytest" in line and not line.lstrip().startswith("#")]
    assert ci == [readme[0].replace("pip install ", "pip install -q ", 1)], (ci, readme)
    flags = readme[0].split("pytest", 1)[1].split()
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    if any(f in flags for f in ("-n", "--dist", "--no-loadscope-reorder")):
        assert any(req.startswith("pytest-xdist>=3.8") for req in extra), extra
