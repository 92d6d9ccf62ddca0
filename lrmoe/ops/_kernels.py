"""Finding the Triton kernels (``lrmoe_kernels``) from lrmoe.ops.

An installed lrmoe (``pip install -e .``) maps the import package ``lrmoe_kernels`` to the folder ``kernels/``.
A source checkout used through PYTHONPATH has no such package; then the folder beside ``lrmoe/`` is loaded under
that name, so the CUDA kernels and the benchmarks work there too. Without Triton there is nothing to load and the
callers fall back to their pure-PyTorch reference.

Kernel modules are imported lazily, at the first CUDA call, so importing lrmoe stays cheap and does not fix
Triton's interpreter mode (TRITON_INTERPRET must be set before any @triton.jit function is defined).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["kernel_module"]

_PACKAGE = "lrmoe_kernels"


def _ensure_package() -> bool:
    """Make ``lrmoe_kernels`` importable: installed, or the source tree's ``kernels/``. False if neither."""
    if _PACKAGE in sys.modules or importlib.util.find_spec(_PACKAGE) is not None:
        return True
    init = Path(__file__).resolve().parents[2] / "kernels" / "__init__.py"
    if not init.is_file():
        return False
    spec = importlib.util.spec_from_file_location(_PACKAGE, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PACKAGE] = module
    spec.loader.exec_module(module)
    return True


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """``lrmoe_kernels.<name>``, or None when Triton or the kernels package is not available."""
    if importlib.util.find_spec("triton") is None or not _ensure_package():
        return None
    return importlib.import_module(f"{_PACKAGE}.{name}")
