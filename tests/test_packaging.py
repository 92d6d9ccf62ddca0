"""Package conventions a user's tools rely on: PEP 561's py.typed marker ships in the wheel; README's test command
is the one CI runs. And drift is caught here first: pyproject.toml caps no dependency, the test command installs
the newest release of each, and README's two commands pin the same torch and Triton."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

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


# Dependencies that may carry an upper cap or an == pin, each with the tested incompatibility that needs it:
# name -> reason. None now: a cap would hold users on old releases and hide the next upstream change from CI.
CAPPED: dict[str, str] = {}


def capped(requirements: list[str]) -> list[str]:
    """The requirements whose specifiers exclude newer releases (<, <=, ==, ===, ~=); not a marker's condition."""
    return [text for text in requirements
            if any(spec.operator in ("<", "<=", "==", "===", "~=") for spec in Requirement(text).specifier)]


def pyproject_requirements() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = config["project"]["optional-dependencies"]
    return [*config["build-system"]["requires"], *config["project"]["dependencies"], *sum(extras.values(), [])]


def test_pyproject_caps_no_dependency_without_a_reason():
    """So the test command's install brings the newest release of each dependency, and an upstream change fails
    CI here, not in a user's hands (torchtitan was pinned ==0.3.0)."""
    requirements = pyproject_requirements()
    assert len(requirements) >= 10 and any(r.startswith("torchtitan") for r in requirements)
    unexplained = [r for r in capped(requirements) if Requirement(r).name not in CAPPED]
    assert not unexplained, f"capped or pinned without a reason in CAPPED: {unexplained}"
    assert all(CAPPED.values())


def test_the_cap_check_reads_specifiers_not_markers():
    reqs = ["a<2", "b==1.0", "c~=1.2", "d<=3,>=1", "e>=1", "f", "g!=1.3", "h; python_version < '3.12'", "i>1"]
    assert capped(reqs) == ["a<2", "b==1.0", "c~=1.2", "d<=3,>=1"]


def readme_commands() -> tuple[str, str]:
    """README's demo command and its test command (the pip install lines)."""
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
             if line.strip().startswith("pip install") and "&&" in line]
    (demo,) = [line for line in lines if "lrmoe demo" in line]
    (test,) = [line for line in lines if "pytest" in line]
    return demo, test


def pins(command: str) -> dict[str, str]:
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', command))


def test_readme_commands_pin_the_same_torch_and_triton_and_the_test_command_upgrades_the_rest():
    """Both commands name torch (the CPU wheel CI's machine keeps on disk) and its partner Triton; the demo's once
    named no Triton and got the newest (3.9) beside torch 2.13, whose partner is 3.7.1. The test command upgrades
    every other package to the newest release pyproject.toml allows (without -U pip keeps what is installed), and
    the torch it pins is one pyproject.toml allows."""
    demo, test = readme_commands()
    assert set(pins(test)) == {"torch", "triton"} and pins(demo) == pins(test), (demo, test)
    assert re.search(r"pip install -U --upgrade-strategy eager ", test), test
    torch_spec = next(Requirement(r).specifier for r in pyproject_requirements() if Requirement(r).name == "torch")
    assert pins(test)["torch"] in torch_spec
