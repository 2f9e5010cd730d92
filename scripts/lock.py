"""Write the lock the two README commands install from: the exact versions in this environment.

    .venv/bin/python scripts/lock.py          # `make upgrade` runs it, then the suite and the conformance run

Two constraints files per Python version, in scripts/locks/:

- `pyX.Y.txt`: every distribution that the package with its `test` and `sentence-transformers` extras, and
  its build (hatchling, jupyter-builder, hatch-jupyter-builder), need, at the installed versions, except
  torch and what only torch needs. `make` installs with it, also while pip builds the package, so a new
  release of anything changes nothing until `make upgrade` has tested it.
- `torch-pyX.Y.txt`: what only torch needs (sympy, networkx, ...), used only when `make` installs the
  default CPU torch itself. A torch you installed first (a CUDA build) keeps its own requirements: neither
  file names torch, nor anything that only torch needs.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCKS = Path(__file__).resolve().parent / "locks"
PROJECT = "overmind_jupyter"
ROOT_EXTRAS = ("test", "sentence-transformers")
BUILD = ("hatchling", "jupyter-builder", "hatch-jupyter-builder")  # pyproject.toml's [build-system] and hook
# Heads the pins only pip's isolated build environment installs (the venv need not have them).
BUILD_ONLY = "# The build's own, for pip's isolated build environment:"


def installed() -> dict[str, importlib.metadata.Distribution]:
    return {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions()}


def closure(roots: list[Requirement], dists: dict[str, importlib.metadata.Distribution],
            stop: frozenset[str] = frozenset()) -> set[str]:
    """The installed distributions `roots` need, following each one's requirements (with the extras asked
    for and markers evaluated here), without entering the distributions named in `stop`."""
    walked: set[tuple[str, frozenset[str]]] = set()
    todo = list(roots)
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(canonicalize_name(e) for e in req.extras)
        if name in stop or name not in dists or (name, extras) in walked:
            continue
        walked.add((name, extras))
        for text in dists[name].requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append(sub)
    return {name for name, _ in walked}


def pins(names: set[str], dists: dict[str, importlib.metadata.Distribution]) -> list[str]:
    return [f"{name}=={dists[name].version}" for name in sorted(names)]


def write(path: Path, header: str, lines: list[str]) -> None:
    path.write_text(header + "\n".join(lines) + "\n")
    print(f"wrote {path.relative_to(LOCKS.parent.parent)} ({sum(not x.startswith('#') for x in lines)} pins)")


def main() -> int:
    dists = installed()
    missing = [name for name in (PROJECT, *BUILD) if canonicalize_name(name) not in dists]
    if missing:
        raise SystemExit(f"not installed here: {', '.join(missing)}; run `make upgrade`, which installs them")
    project = closure([Requirement(f"{PROJECT}[{','.join(ROOT_EXTRAS)}]")], dists, stop=frozenset({"torch"}))
    build_only = closure([Requirement(b) for b in BUILD], dists, stop=frozenset({"torch"})) - project
    without_torch = (project | build_only) - {canonicalize_name(PROJECT)}
    torch_only = closure([Requirement("torch")], dists) - without_torch - {"torch"}
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    LOCKS.mkdir(exist_ok=True)
    made = (f"# Written by `make upgrade` (scripts/lock.py), committed once the suite and the conformance run passed"
            f" on it; Python {version}, torch {dists['torch'].version}.\n")
    write(LOCKS / f"py{version}.txt",
          made + "# Everything the package, its test extra and its build need, but torch and what only torch needs.\n",
          [*pins(without_torch - build_only, dists), BUILD_ONLY, *pins(build_only, dists)])
    write(LOCKS / f"torch-py{version}.txt",
          made + "# What only torch needs; used only when make installs its default CPU torch itself.\n",
          pins(torch_only, dists))
    return 0


if __name__ == "__main__":
    sys.exit(main())
