"""Every private PyTorch name lrmoe uses is in lrmoe/ops/_torch_internals.py, which lists them for
tests/ops/test_torch_internals.py to resolve: read off the source (ast) of every other module of lrmoe/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERNALS = ROOT / "lrmoe/ops/_torch_internals.py"
_DOTTED = re.compile(r"torch(\.\w+)*(:\w+)?")  # a whole string naming a torch object ("module:attribute" too)


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_torch_names(source: str) -> dict[int, str]:
    """Line -> the private torch name used there (the longest, one per line): an attribute of ``torch`` with a
    component starting with '_' (dunders aside), an import of one, or a string that names one."""
    found: dict[int, str] = {}

    def add(line: int, name: str) -> None:
        if len(name) > len(found.get(line, "")):
            found[line] = name

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if parts and parts[0] == "torch" and _private(parts[1:]):
                add(node.lineno, ".".join(parts))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and _private(parts[1:]):
                    add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                if _private([*node.module.split(".")[1:], alias.name]):
                    add(node.lineno, f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value):
            if _private(re.split(r"[.:]", node.value)[1:]):
                add(node.lineno, node.value)
    return found


def test_no_private_torch_name_outside_the_internals_module():
    files = sorted(path for path in (ROOT / "lrmoe").rglob("*.py") if path != INTERNALS)
    assert len(files) > 20
    used = [f"{path.relative_to(ROOT)}:{line} {name}" for path in files
            for line, name in sorted(private_torch_names(path.read_text()).items())]
    assert not used, "private torch names outside lrmoe/ops/_torch_internals.py:\n" + "\n".join(used)


def test_the_reader_finds_each_form_and_nothing_public():
    source = '''
"""Docs may name torch._grouped_mm."""
import torch._dynamo
import torch.nn.functional as F
from torch._subclasses import FakeTensor
from torch.utils import _pytree
from torch.fx.experimental.symbolic_shapes import guard_or_false
x = torch._C._current_graph_task_id()
y = torch.utils._pytree.register_dataclass
z = resolve("torch._library.effects:EffectType")
ok = (torch.__version__, torch.compiler.is_compiling(), F.silu, "torch.nn")
'''
    found = private_torch_names(source)
    assert sorted(found.values()) == ["torch._C._current_graph_task_id", "torch._dynamo",
                                      "torch._library.effects:EffectType", "torch._subclasses.FakeTensor",
                                      "torch.utils._pytree", "torch.utils._pytree.register_dataclass"]
    # The internals module itself uses them (it is the one place that may).
    assert len(private_torch_names(INTERNALS.read_text())) >= 8
