"""Imports run one way, lrmoe.nn -> lrmoe.functional -> lrmoe.ops -> kernels/ (docs/design.md, 'Package layout'):
read off every module's import statements (function-level ones too), without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (folder, packages its modules must not import)
RULES = [
    ("lrmoe/ops", ("lrmoe.functional", "lrmoe.nn")),
    ("lrmoe/functional", ("lrmoe.nn",)),
    ("kernels", ("lrmoe",)),
]


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute name) of every module a file in ``package`` imports, and of every name it imports from one
    (``from a import b`` gives a and a.b); relative imports resolved against ``package``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join([*parts, node.module] if node.module else parts)
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _imports(path: Path) -> list[tuple[int, str]]:
    return imported_modules(path.read_text(), ".".join(path.relative_to(ROOT).parts[:-1]))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("folder, forbidden", RULES, ids=[rule[0] for rule in RULES])
def test_no_module_imports_up(folder, forbidden):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    upward = {f"{path.relative_to(ROOT)}:{line}": module  # one entry per statement
              for path in files for line, module in reversed(_imports(path))
              if any(_within(module, package) for package in forbidden)}
    assert not upward, "\n".join(f"{where} imports {module}" for where, module in upward.items())


def test_the_reader_finds_every_kind_of_import():
    source = "import torch\ndef f():\n    from ..functional import experts\n    import lrmoe.nn.lrmoe as m\n"
    found = {module for _, module in imported_modules(source, "lrmoe.ops")}
    assert found == {"torch", "lrmoe.functional", "lrmoe.functional.experts", "lrmoe.nn.lrmoe"}
    assert {m for _, m in imported_modules("from . import _kernels", "lrmoe.ops")} == {"lrmoe.ops",
                                                                                       "lrmoe.ops._kernels"}
    # And in the tree: functional imports ops, nn imports functional (the direction the rules allow).
    assert any(_within(m, "lrmoe.ops") for p in (ROOT / "lrmoe/functional").rglob("*.py") for _, m in _imports(p))
    assert any(_within(m, "lrmoe.functional") for p in (ROOT / "lrmoe/nn").rglob("*.py") for _, m in _imports(p))
