"""Import a script of benchmarks/ as a module, for the tests of its logic that need no GPU (the scripts are not a
package, and they import each other as when run from benchmarks/)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str, monkeypatch: pytest.MonkeyPatch):
    """benchmarks/<name>.py as a fresh module, with benchmarks/ on sys.path and the module in sys.modules for as long
    as ``monkeypatch`` lasts (dataclasses look their module up there while it executes)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def load_script_once(name: str):
    """load_script for a module-scoped fixture: sys.path and sys.modules are restored once the script has run."""
    with pytest.MonkeyPatch.context() as mp:
        return load_script(name, mp)
