"""Version pairs the test setup refuses (tests/conftest.py), in a module of its own so tests can import it by a
name no other folder's conftest.py shadows."""

from __future__ import annotations


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run these kernel tests with these versions, or None. Triton before 3.7 (3.6 is
    torch 2.11's) converts one-element arrays to Python scalars, which numpy 2.4 refuses: every kernel test then
    fails with "only 0-dimensional arrays can be converted to Python scalars" (seen with torch 2.11 + Triton 3.6.0 +
    numpy 2.4.6 on the CPU; numpy 2.3.5 passed)."""
    def major_minor(version: str) -> tuple[int, int]:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1, used without a GPU) fails with numpy "
                f"{numpy_version}: install numpy<2.4 or Triton>=3.7")
    return None
