"""No module or package of this repository is importable under a name that a dependency uses: not from the
repository root (on sys.path as the working directory), not from benchmarks/ or examples/ (on sys.path as a
script's folder), not under pytest (the test folders that pytest and conftest files put on sys.path).
transformers >= 5.25 imports Hugging Face's ``kernels``; a ``kernels`` of ours first on sys.path broke every
transformers import from the checkout."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_DIRS = [ROOT, ROOT / "benchmarks", ROOT / "examples"]

FIND = """
import importlib.util, json
spec = importlib.util.find_spec("kernels")
print(json.dumps(None if spec is None else [spec.origin, list(spec.submodule_search_locations or [])]))
"""


def _inside(path: str | None) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(ROOT)


@pytest.fixture(scope="module")
def dependency_kernels(tmp_path_factory) -> dict[str, str]:
    """Environment under which ``import kernels`` has a dependency to find: Hugging Face's package where it is
    installed (transformers >= 5.25 requires it), else a stand-in package put after the script's folder on
    sys.path, where an installed dependency sits."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        importlib.metadata.distribution("kernels")
        return env
    except importlib.metadata.PackageNotFoundError:
        stand_in = tmp_path_factory.mktemp("site") / "kernels"
        stand_in.mkdir()
        (stand_in / "__init__.py").write_text("")
        return {**env, "PYTHONPATH": str(stand_in.parent)}


@pytest.mark.parametrize("folder", SCRIPT_DIRS, ids=lambda p: p.name or "root")
def test_import_kernels_never_resolves_inside_the_repository(folder, dependency_kernels):
    """Run as ``python -c`` from ``folder``: the working directory comes first on sys.path, as it does for a user
    who runs a script or ``python -m pytest`` there."""
    run = subprocess.run([sys.executable, "-c", FIND], cwd=folder, env=dependency_kernels, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout)
    assert found is not None, "no `kernels` package found at all"
    origin, locations = found
    assert not _inside(origin) and not any(_inside(p) for p in locations), (folder, found)


def _our_top_level_names(folder: Path) -> set[str]:
    """Names that ``import NAME`` finds in ``folder`` as a module or a regular package (a folder without
    ``__init__.py`` is a namespace portion, which yields to any module or regular package later on sys.path)."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.parent.name for p in folder.glob("*/__init__.py")}
    return names


def _dependency_names() -> dict[str, list[str]]:
    """Top-level import names of every installed distribution other than lrmoe itself."""
    return {name: dists for name, dists in importlib.metadata.packages_distributions().items()
            if any(d.lower() != "lrmoe" for d in dists)}


def test_no_folder_on_a_path_we_put_first_holds_a_dependency_name():
    """The repository root, the script folders and every folder of tests/ (pytest's rootdir-relative sys.path
    entries, and tests/benchmarks/conftest.py's insertion of benchmarks/) against the installed distributions'
    top-level names. Names only Python's own test runner could reach (``conftest``) do not count."""
    dependencies = _dependency_names()
    folders = [*SCRIPT_DIRS, ROOT / "tests", *[p for p in (ROOT / "tests").rglob("*") if p.is_dir()
                                              and "__pycache__" not in p.parts]]
    clashes = {str(f.relative_to(ROOT)) or ".": sorted(n for n in _our_top_level_names(f) - {"conftest"}
                                                       if n in dependencies)
               for f in folders}
    assert not {f: n for f, n in clashes.items() if n}, {f: (n, [dependencies[x] for x in n])
                                                          for f, n in clashes.items() if n}


def test_the_name_check_finds_a_clash(tmp_path):
    """The check above is not vacuous: a folder laid out as this repository once was (a regular package
    ``kernels``, a script ``torch.py``) is caught."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "torch.py").write_text("")
    (tmp_path / "namespace_only").mkdir()
    assert _our_top_level_names(tmp_path) == {"kernels", "torch"}
    assert "torch" in _dependency_names()
