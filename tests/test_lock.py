"""The two README commands install what was tested: the lock in scripts/locks/ (issue 35)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
BUILD_ONLY = "# The build's own"  # the heading of scripts/lock.py's section of build-only pins
VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def pins(path: Path, *, build: bool = True) -> dict[str, str]:
    """The exact versions `path` pins; without those of the build's own section unless `build`."""
    found = {}
    for line in path.read_text().splitlines():
        if line.startswith(BUILD_ONLY) and not build:
            break
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not an exact version"
            found[canonicalize_name(req.name)] = spec.version
    return found


def test_make_test_runs_on_the_locked_versions() -> None:
    """`make test` passes OVERMIND_LOCK: every version installed is the lock's (a stale venv, or an
    install that ignored the lock, fails here rather than in some other test); the build's own pins are
    for pip's isolated build environment, not the venv."""
    lock = os.environ.get("OVERMIND_LOCK")
    if not lock:
        pytest.skip("not run by `make test` (OVERMIND_LOCK unset): this environment's versions are its own")
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    wrong = {name: (version, installed.get(name)) for name, version in pins(REPO / lock, build=False).items()
             if installed.get(name) != version}
    assert wrong == {}, f"locked != installed: {wrong}; `rm .venv/.installed && make setup` installs the lock"


def test_the_lock_leaves_torch_to_the_user() -> None:
    """A CUDA torch installed first keeps its own requirements: the lock names neither torch nor anything
    only torch needs; those are in the torch lock, used only with the default CPU torch."""
    locks = REPO / "scripts" / "locks"
    lock, torch_lock = locks / f"py{VERSION}.txt", locks / f"torch-py{VERSION}.txt"
    if not lock.exists():
        pytest.skip(f"no lock for Python {VERSION}: `make upgrade` writes one")
    main, torch_only = pins(lock), pins(torch_lock)
    assert "torch" not in main and "torch" not in torch_only
    assert not [n for n in main if n.startswith(("nvidia-", "triton"))]
    assert {"sympy", "networkx"} <= set(torch_only) and not set(main) & set(torch_only)
    assert {"transformers", "diffusers", "peft", "hatchling", "pytest"} <= set(main)
    assert "hatchling" not in pins(lock, build=False), "the build's own pins are in their own section"
