"""The shape of overmind_jupyter/adapters (issue 21): the engine and the splitter use the gate's public surface
only, no module of the package reaches into another's underscore names, the arrow between gating, batching and
splitting points one way (not even an annotation-only import back), and each helper is defined once."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "overmind_jupyter" / "adapters"


def _tree(name: str) -> ast.Module:
    return ast.parse((PACKAGE / f"{name}.py").read_text())


def _modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_another_module_s_underscore_names() -> None:
    found = []
    for module in _modules():
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.ImportFrom) and node.level:
                found += [f"{module}: from .{node.module} import {a.name}" for a in node.names if _private(a.name)]
    assert found == []


def test_the_engine_and_the_splitter_use_no_private_member_of_anything_else() -> None:
    """`x._name` only where `x` is `self` (its own state), never the gate (`gate._key`, `gate._host.target`)."""
    found = []
    for module in ("batching", "splitting", "batchable", "inputs", "guarding"):
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    # PEFT's own members read by the guard are named here, one by one
    assert [f for f in found if "_orig_mod" not in f] == []


def test_gating_batching_splitting_import_one_way() -> None:
    imported: dict[str, set[str]] = {}
    for module in _modules():
        names = set()
        for node in ast.walk(_tree(module)):  # every import, under TYPE_CHECKING too
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    names.add(node.module)
                else:
                    names.update(a.name for a in node.names)
        imported[module] = names
    assert {"batching", "splitting"} <= imported["gating"]
    for low in ("batching", "splitting", "batchable", "inputs", "guarding", "host", "routing", "switching"):
        assert "gating" not in imported[low], f"{low} imports gating"
    assert "batching" not in imported["splitting"] and "splitting" not in imported["batching"]


def test_one_rows_of_and_one_pad_id() -> None:
    defined: dict[str, list[str]] = {}
    for module in _modules():
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in ("rows_of", "pad_id", "eos_ids"):
                defined.setdefault(node.name.lstrip("_"), []).append(module)
    assert defined == {"rows_of": ["inputs"], "pad_id": ["inputs"], "eos_ids": ["inputs"]}
