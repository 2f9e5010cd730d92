"""No module of the suite hides an installed one (issue 35).

transformers 5.25 began importing Hugging Face's `kernels` package at model-definition time, and the
suite's old helper `tests/kernels.py`, on sys.path under that name, answered instead: most of `make test`
failed on a fresh clone without a change of ours. The suite is now the package `tests` with its helpers in
`tests.helpers`; these tests keep it that way for whatever the next release imports.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The packages this repository installs: the only top-level names of ours that may also be a distribution's.
OURS = {"overmind_jupyter", "kernel_server"}


def top_level_names(directory: Path) -> dict[str, Path]:
    """What `import NAME` finds in `directory`: modules and regular packages (a folder without
    `__init__.py` is a namespace portion, which never hides a module found anywhere on the path)."""
    names = {}
    for path in directory.iterdir():
        if (path.is_file() and path.suffix in (".py", ".pyc")) or path.suffix == ".so":
            names[path.name.split(".")[0]] = path
        elif path.is_dir() and (path / "__init__.py").is_file():
            names[path.name] = path
    return names


def installed_names() -> dict[str, str]:
    """Every importable top-level name that is not ours -> who provides it (a distribution, the standard
    library, or a module built into the interpreter)."""
    names = dict.fromkeys(sys.stdlib_module_names, "the standard library")
    names.update(dict.fromkeys(sys.builtin_module_names, "the interpreter"))
    for name, distributions in importlib.metadata.packages_distributions().items():
        others = [d for d in distributions if d.replace("-", "_").lower() != "overmind_jupyter"]
        if others and not name.startswith("_"):
            names[name] = f"the distribution {others[0]}"
    return {name: who for name, who in names.items() if name not in OURS}


def shadowing(directories: list[Path]) -> list[str]:
    """The modules in `directories` named like an installed top-level module, as sentences saying what to do."""
    installed = installed_names()
    found = []
    for directory in directories:
        for name, path in sorted(top_level_names(directory).items()):
            if name in installed:
                found.append(f"{path} hides `import {name}` of {installed[name]}: move it into tests/helpers/ "
                             "(imported as `tests.helpers.…`) or rename it")
    return found


def suite_path_entries() -> list[Path]:
    """The folders of this repository that the suite's processes have on sys.path: this process's path
    (pytest's rootdir insertion, the editable install) and the PYTHONPATH every started process inherits."""
    entries = [*sys.path, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    environment = Path(sys.prefix).resolve()  # .venv lies in the repository: its site-packages are not ours
    found: list[Path] = []
    for entry in entries:
        path = Path(entry or os.getcwd()).resolve()
        ours = (path == REPO or REPO in path.parents) and not (path == environment or environment in path.parents)
        if ours and path.is_dir() and path not in found:
            found.append(path)
    return found


def test_no_module_of_the_suite_hides_an_installed_one() -> None:
    directories = suite_path_entries()
    assert REPO in directories, "the suite imports its helpers as `tests.helpers`, from the repository's root"
    assert shadowing(directories) == []


def test_the_check_finds_a_helper_named_like_an_installed_module(tmp_path: Path) -> None:
    # The layout that broke: a helper module named as a library imports it, on the path as a top-level name.
    (tmp_path / "kernels.py").write_text("")  # Hugging Face's `kernels`, which transformers imports
    (tmp_path / "json.py").write_text("")  # the standard library's
    (tmp_path / "safetensors").mkdir()
    (tmp_path / "safetensors" / "__init__.py").write_text("")
    (tmp_path / "namespace_only").mkdir()  # no __init__.py: never hides anything
    (tmp_path / "overmind_jupyter.py").write_text("")  # ours
    found = shadowing([tmp_path])
    names = sorted(line.split("`import ")[1].split("`")[0] for line in found)
    expected = ["json", "safetensors"] + (["kernels"] if "kernels" in installed_names() else [])
    assert names == sorted(expected), found
    assert all("tests/helpers/" in line for line in found)


def test_the_suites_helpers_are_not_top_level_names() -> None:
    """Each helper is reached through the package, whatever the installed libraries are called."""
    helpers = top_level_names(REPO / "tests" / "helpers")
    assert {"kernels", "snippets", "tiny_modules"} <= set(helpers)
    assert all(path != REPO / "tests" / "helpers" for path in suite_path_entries())
    assert all(path != REPO / "tests" for path in suite_path_entries())
