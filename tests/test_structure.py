"""The shape of the code (docs/design.md, "Parts"): imports run one way, no module reaches into another's
underscore names, `kernel_server` (the daemon and its client) imports nothing of `overmind_jupyter`, and
the three version strings agree. The checker reads the source with `ast`; it is tried on small made-up
packages first, so that a checker that finds nothing cannot pass."""

from __future__ import annotations

import ast
import json
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("kernel_server", "overmind_jupyter")


@dataclass
class Module:
    name: str
    path: Path
    imports: set[str] = field(default_factory=set)  # modules of ours it imports, at any depth of its code
    private: list[str] = field(default_factory=list)  # "line: what" for each use of another's _name


def read_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Module]:
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = Module(name, path)
    for module in modules.values():
        _read_imports(module, modules, packages)
    return modules


def _read_imports(module: Module, modules: dict[str, Module], packages: tuple[str, ...]) -> None:
    tree = ast.parse(module.path.read_text(), str(module.path))
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> module of ours it is bound to
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in packages:
                    module.imports.add(_known(alias.name, modules))
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] not in packages:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:  # `from . import arena`: the submodule
                    module.imports.add(sub)
                    aliases[alias.asname or alias.name] = sub
                else:
                    module.imports.add(_known(base, modules))
                    if _private(alias.name) and base != module.name:
                        module.private.append(f"{node.lineno}: from {base} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and aliases[node.value.id] != module.name):
            module.private.append(f"{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    module.imports.discard(module.name)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under `if TYPE_CHECKING:` (annotations only, never run)."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack += node.orelse
            continue
        out.append(node)
        stack += ast.iter_child_nodes(node)
    return out


def _known(name: str, modules: dict[str, Module]) -> str:
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in sorted(modules[name].imports):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == name:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def problems(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    modules = read_modules(root, packages)
    out = [f"import circle: {' -> '.join(group)}" for group in circles(modules)]
    out += [f"{m.path.relative_to(root)}:{use} (another module's underscore name)"
            for m in modules.values() for use in m.private]
    out += [f"{m.name} imports {', '.join(sorted(i for i in m.imports if i.startswith('overmind_jupyter')))}"
            " (kernel_server may import nothing of overmind_jupyter)"
            for m in modules.values() if m.name.startswith("kernel_server")
            and any(i.startswith("overmind_jupyter") for i in m.imports)]
    return out


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_the_checker_finds_a_circle_a_private_import_and_a_wrong_way_arrow(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "kernel_server/__init__.py": "",
        "kernel_server/daemon.py": "from . import ledger\n",
        "kernel_server/ledger.py": "def handler():\n    from .daemon import Reply\n",
        "kernel_server/worker.py": "import overmind_jupyter.loading\n",
        "overmind_jupyter/__init__.py": "",
        "overmind_jupyter/loading.py": "from kernel_server import daemon\ndaemon._secret\n",
        "overmind_jupyter/batching.py": "from .gating import _rows_of\nfrom . import gating\ngating._names\n",
        "overmind_jupyter/gating.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from .batching import Engine\n_rows_of = 1\n",
    })
    found = problems(root)
    assert "import circle: kernel_server.daemon -> kernel_server.ledger" in found
    assert "kernel_server.worker imports overmind_jupyter.loading (kernel_server may import nothing of " \
           "overmind_jupyter)" in found
    assert {p.split(" (")[0] for p in found if "underscore" in p} == {
        "overmind_jupyter/loading.py:2: kernel_server.daemon._secret",
        "overmind_jupyter/batching.py:1: from overmind_jupyter.gating import _rows_of",
        "overmind_jupyter/batching.py:3: overmind_jupyter.gating._names",
    }
    assert len(found) == 5, "an import under TYPE_CHECKING is no circle"


def test_imports_run_one_way_and_no_module_uses_another_s_underscore_names() -> None:
    found = problems(REPO)
    assert not found, "\n".join(found)


def test_the_versions_agree() -> None:
    import kernel_server
    import overmind_jupyter

    package_json = json.loads((REPO / "labextension" / "package.json").read_text())
    assert overmind_jupyter.__version__ == kernel_server.__version__ == package_json["version"]


def test_every_operation_has_one_handler_and_the_protocol_names_it(tmp_path: Path) -> None:
    from kernel_server import protocol
    from kernel_server.daemon import Daemon
    from kernel_server.operations import Op

    daemon = Daemon(tmp_path, budget=1 << 20)
    try:
        assert set(daemon.handlers) == set(Op)
    finally:
        daemon.compactor.stop()
    listed = protocol.__doc__ or ""
    assert [op.value for op in Op if op.value not in listed] == [], "protocol.py's docstring lists every operation"


def test_the_code_cites_the_project_s_own_design_document() -> None:
    """Comments cite docs/design.md (the repository's), and only invariants it has."""
    import re

    numbered = set(re.findall(r"^(\d+)\. \*\*", (REPO / "docs" / "design.md").read_text(), re.MULTILINE))
    wrong = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            text = path.read_text()
            wrong += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in re.finditer(r"(?<!docs/)DESIGN\.md", text)]
            wrong += [f"{path.relative_to(REPO)}: invariant {n} (docs/design.md has {sorted(numbered)})"
                      for n in re.findall(r"design\.md,? invariant (\d+)", text) if n not in numbered]
    assert not wrong, "\n".join(wrong)


# What front-end code looks like in a Python string: a function, an arrow, the DOM, an ES module's export,
# a CSS rule (a selector, then a declaration ended by ";" inside braces).
_FRONT_END = re.compile(r"\bfunction\b\s*\w*\s*\(|=>|\bdocument\.|\bexport default\b|[\w\]\)]\s*\{[^{}]*:[^{}]*;")


def front_end_strings(root: Path) -> list[str]:
    """The JavaScript and CSS held in Python strings under `root`'s overmind_jupyter/widgets/, and every
    `_esm`/`_css` that is not a call (`frontend(name)`, the built files): "path:line: what"."""
    found = []
    for path in sorted((root / "overmind_jupyter" / "widgets").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _FRONT_END.search(node.value):
                found.append(f"{where}:{node.lineno}: {node.value.strip()[:40]!r}")
            if isinstance(node, ast.Assign):
                names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                if {"_esm", "_css"} & set(names) and not isinstance(node.value, ast.Call):
                    found.append(f"{where}:{node.lineno}: {', '.join(names)} = {ast.unparse(node.value)[:40]}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_the_checker_of_front_end_strings_finds_javascript_and_css(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "overmind_jupyter/widgets/table.py": '''
            """A table: `{"event": "evict", "key": ...}` from its view; no code in this docstring."""
            from .live import LiveView, frontend

            class Table(LiveView):
                _esm, _css = frontend("table")

            class Inline(LiveView):
                _esm = "export default { render({ model, el }) { el.textContent = 'x'; } };"
                _css = ".om-w { color: red; }"

            HELPERS = r"""
            function h(tag) { return document.createElement(tag); }
            """
            STYLE = ".om-bar {\\n  display: flex;\\n}"
            ARROW = "(x) => x + 1"
        ''',
    })
    found = front_end_strings(root)
    assert [f.split(": ", 1)[0] for f in found] == [
        f"overmind_jupyter/widgets/table.py:{n}" for n in (9, 9, 10, 10, 12, 15, 16)], found


def test_no_widget_holds_javascript_or_css_in_a_python_string() -> None:
    """The widgets' front end is TypeScript and CSS in labextension/src/widgets/, built into files that
    anywidget loads (widgets/live.py), not strings in the widgets' modules."""
    found = front_end_strings(REPO)
    assert not found, "\n".join(found)


def test_the_files_run_first_are_the_suite_s_own_and_named_once() -> None:
    """conftest's LONGEST_FIRST names files of the suite: a renamed one would silently run in its place."""
    from tests.conftest import LONGEST_FIRST

    assert sorted(set(LONGEST_FIRST)) == sorted(LONGEST_FIRST), "a file named twice"
    assert [name for name in LONGEST_FIRST if not (REPO / "tests" / name).is_file()] == []
