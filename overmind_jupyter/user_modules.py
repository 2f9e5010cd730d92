"""The user's own modules (a .py beside the notebook, a package installed in place: Note [Installed code] in
reads.py) as a key holds them: which of them a module imports, found by their files without importing them,
whether a module still runs what its file holds, and what it holds that its file does not bind. Each file is
read once per version of it (its identity); keys.py keys what these say."""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

from .errors import Uncacheable
from .module_files import Finder, named
from .reads import code_digest, is_users_module, maybe_users

__all__ = [
    "CLASS_BOOKKEEPING",
    "GONE",
    "cell_contents",
    "check_runs_its_file",
    "defined_in",
    "file_bindings",
    "held_otherwise",
    "literal_form",
    "module_file",
    "read_at_import",
    "stat_identity",
    "users_file",
    "users_imports",
]

_LITERAL_ITEMS = 10_000  # values a compared literal may hold (a key's own limit on a container's items)
_LITERAL_DEPTH = 32  # and how deep it may nest (a key's own limit)
# What a class's namespace holds for Python itself, not for what the class does.
CLASS_BOOKKEEPING = frozenset({
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__", "__orig_bases__",
    "__parameters__", "__static_attributes__", "__firstlineno__", "__slots__", "__abstractmethods__", "_abc_impl",
    "__annotate__", "__annotate_func__", "__annotations_cache__"})


def stat_identity(st: os.stat_result) -> list[int]:
    """What a key holds of a file: its device, inode, size, mtime and ctime (Note [Never stale] in keys.py)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def cell_contents(cell: types.CellType) -> Any:
    """What a closure's cell holds; None for one not filled yet."""
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet (a function defined before the name it closes over)
        return None


# Note [The user's modules a module imports]
# A class or function of a module with a file is keyed by its name and that file's identity; for a module
# of the user's (Note [Installed code] in reads.py) that is not enough: `model.py`'s class builds a
# `Block` of `blocks.py`, which builds an `Attention` of `attention.py` or reads a constant there, so an
# edit of `attention.py` alone changes what the load builds. So such a name is keyed with the identity
# of every module of the user's that its module imports, and that those import in turn: the import
# statements of each file (parsed once per version of the file), at its top level and inside its functions
# and classes too (`Block.__init__` doing `from attention import Attention`), not those under `if
# TYPE_CHECKING:` (never run), resolved as Python resolves them, and found by their files whether this
# process imported them yet or not (Note [Modules found by their file] in module_files.py): so the key is the
# same in every process, in one whose `Block` was built already and in one that has not run that import. A
# name no module answers to (an optional part behind `try: import ...`) is keyed as missing. A library's
# module is keyed by its name and version alone, as before; a module imported by a name computed when it
# runs (`importlib.import_module(name)`) is not followed. A function of the notebook that imports a module of
# the user's in its body has that module keyed the same way (`_imported_by`), and so has one whose body calls
# `importlib.import_module` or `__import__` with the name written out (`reads.import_statements`; in a
# module's file, only its import statements are read).
def users_imports(module: str, finder: Finder | None = None) -> dict[str, Any]:
    """The identity of the file of each module of the user's that `module` imports, directly or through
    another such module, or {"missing": True} for a name none answers to (Note [The user's modules a module
    imports])."""
    finder = finder or Finder()
    found: dict[str, Any] = {}
    seen = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        part = users_file(name, finder)
        if isinstance(part, tuple):
            file, found[name] = part
            todo += [m for m in _imports(name, file, tuple(part[1])) if m not in seen]
        elif part is not None:
            found[name] = part
    found.pop(module, None)  # its own file is keyed beside its name
    return dict(sorted(found.items()))


def users_file(name: str, finder: Finder) -> tuple[str, list[int]] | dict[str, bool] | None:
    """(file, its identity) of the module an import of `name` would run, where it is the user's (Note
    [Installed code] in reads.py); {"missing": True} where no module answers to the name though one could;
    None for a module that is not the user's or has no file (a namespace package, one made in memory), and
    for a name that can be no module (what `from a import b` takes from a module that is no package).
    Found once a key (`finder.memo`)."""
    if name not in finder.memo:
        finder.memo[name] = _find_users_file(name, finder)
    return finder.memo[name]  # type: ignore[no-any-return]


def _find_users_file(name: str, finder: Finder) -> tuple[str, list[int]] | dict[str, bool] | None:
    top = name.partition(".")[0]
    if top == "__main__" or not maybe_users(top):
        return None
    where = finder.find(top)
    if where is None:
        return {"missing": True} if name == top else None
    users = finder.memo.get((top, "users"))
    if users is None:  # (its package's, asked once a key: it reads where each of the places really lies)
        users = finder.memo[top, "users"] = is_users_module(top, None if top in sys.modules else where.places)
    if not users:
        return None
    if name != top:
        where = finder.find(name)
        if where is None:
            above = finder.find(name.rpartition(".")[0])
            return {"missing": True} if above is not None and above.search is not None else None
    if where.file is None:
        return None
    try:
        return where.file, stat_identity(os.stat(where.file))
    except OSError:  # (removed since it was found)
        return {"missing": True}


# Note [A module that is not its file]
# A module of the user's is keyed by its file's identity (Note [The user's modules a module imports]),
# which says what a process importing the file now would run. A kernel that imported `blocks.py` and saw
# it edited since, without a reload, runs the old code: its load built the old `Block`, stored under the
# new file's identity, and a kernel restarted on the edited file got that model (a stale hit). So before
# such a module is keyed, if its file was written since this process started, its functions and the
# methods of its classes are compared with the code the file compiles to now (compiled once per version
# of the file); where one differs, or is not in the file any more, the load is uncacheable and says to
# reload the module or restart the kernel. A file older than the process is what it imported (and a
# module an import hook rewrote, as pytest rewrites its asserts, never matches a plain compile of its
# file: only its edits are compared). Functions made elsewhere (a library's wrapper) are not compared. Its
# module-level values are compared with what the file binds now as the values of any module of the user's
# are (Note [What a module holds that its file does not bind]): a literal edited and not reloaded is keyed
# by the value the module still holds, a value computed at import is not compared.
def check_runs_its_file(module: str, identity: list[int]) -> None:
    """Raise Uncacheable where `module`, of the user's, whose file has `identity` (`stat_identity`), runs code
    its file no longer holds (Note [A module that is not its file])."""
    mod, file = sys.modules.get(module), module_file(module)
    if mod is None or file is None or identity[3] < _process_started() * 1e9:
        return  # (written before this process started: what it imported is what the file holds)
    codes = [(name, fn.__code__) for name, x in list(vars(mod).items()) if getattr(x, "__module__", None) == module
             for fn in ([x] if isinstance(x, types.FunctionType) else _methods(x) if isinstance(x, type) else [])
             if fn.__code__.co_filename == file]  # (a wrapper made elsewhere runs that code)
    seen = (tuple(identity), tuple(code for _, code in codes))  # the code objects held: none reused meanwhile
    if _runs_its_file.get(module) == seen:
        return
    compiled = _file_codes(file, seen[0])
    if compiled is None:
        return
    for name, code in codes:
        if code_digest(code) not in compiled.get(code.co_qualname, ()):
            raise Uncacheable(
                f"{module}.{name} is not what {file} holds now: the file changed since the module was "
                f"imported; reload it (importlib.reload({module})) or restart the kernel to cache this load")
    _runs_its_file[module] = seen


_runs_its_file: dict[str, tuple[Any, ...]] = {}  # module -> (file identity, its code) found to run its file


@functools.cache
def _process_started() -> float:
    """When this process started, in seconds since the epoch (Linux: its start in clock ticks after the
    boot, /proc/self/stat, and the boot's time, /proc/stat)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK") - 1.0  # (the boot time is in whole seconds)
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0  # unknown: every file is compared


def _methods(cls: type) -> list[types.FunctionType]:
    out = []
    for attr in vars(cls).values():
        v = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        fs = (v.fget, v.fset, v.fdel) if isinstance(v, property) else (v,)
        out += [f for f in fs if isinstance(f, types.FunctionType) and f.__module__ == cls.__module__]
    return out


@functools.lru_cache(maxsize=256)
def _file_codes(file: str, identity: tuple[int, ...]) -> dict[str, set[str]] | None:
    """The digests of the code of every function `file` (at this `identity` of it) defines, by qualname;
    None where it cannot be read or compiled."""
    try:
        with open(file, "rb") as f:
            code = compile(f.read(), file, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError):
        return None
    found: dict[str, set[str]] = {}
    todo = [code]
    while todo:
        for const in todo.pop().co_consts:
            if isinstance(const, types.CodeType):
                found.setdefault(const.co_qualname, set()).add(code_digest(const))
                todo.append(const)
    return found


# Note [What a module holds that its file does not bind]
# A module of the user's is keyed by its file's identity (Note [The user's modules a module imports]), which
# says what the file binds, not what the module holds: a kernel that set `mymodels.WIDTH = 16`, or
# `blocks.Block.WIDTH = 16`, or put a function of its own in `mymodels.build`, runs other code than a fresh
# import of the file (the module's functions read those names when they run), and its load was stored under
# the file's identity, where a kernel on the file's values then got it (a stale hit). So the top level of the
# file is read (parsed once per version of it) for what it binds that can be compared with the module now:
# - a name bound to a literal (`ast.literal_eval`'s: numbers, strings, bytes, bools, None, tuples, lists,
#   dicts and sets of those; or a builtin container made of them, `CFG = dict(width=8)`; `X = ...` or
#   `X: T = ...`, one name as the target), compared by type and value (1, 1.0 and True differ; a list is
#   not a tuple), so a dict changed in a cell (`mymodels.CFG["width"] = 16`) differs;
# - a name bound by `def` or `class`: the module must still hold a function (or class) of this module of
#   that name, defined in this file; a decorated one, found through the wrappers' `__wrapped__` or their
#   closures (a decorator's object that is no function or class, a jit's, is not compared); and such a
#   class's methods must still run code of this file (`replaced_methods`: a cell's `Block.width = lambda
#   self: 16` differs, a method `dataclass` wrote or one the file took from another module does not);
# - a literal attribute of such a class's body (`class Block: WIDTH = 8`), where the class holds a literal
#   now (what a decorator or a metaclass made of it, an enum member, a dataclass's slot, is not compared).
# A name bound twice at the top level (or in the class body), or bound or changed in place by anything
# else there too (an import, a loop, `del`, an `if`'s branches, `X[k] = v`, `X.append(v)`), is not
# compared, nor is one bound before a `from x import *`; nor a value computed at import (`DEVICE = "cuda"
# if ... else "cpu"`, `STARTED = time.time()`; one read from the environment or a file is keyed by what
# it holds: Note [What a module reads when it is imported]), nor a name the file does not bind, nor a
# literal of more than _LITERAL_ITEMS values. A name that the file's functions rebind (`global X`) or change in place
# (`MODELS[name] = cls` in a decorator) is the module's own state (a client made once, a registry of
# classes): it is compared only where it holds a literal now (`configure(16)` setting `WIDTH`), as what
# it holds otherwise may have no key, and was put there by the file's own code; one its functions change
# only by `X += ...` (`global calls; calls += 1`) is a counter of the module's, not compared at all:
# compared, each call of a loader that counts its calls was a miss and another entry (a load that reads
# the count to build its result would be keyed without it). Where the module holds
# something else, or has lost the name, the module's part of the key gets a field `differs`, {module:
# {name: the value it holds now, keyed as a global is}}, so a value that cannot be keyed makes the load
# run plainly, saying so, unless no code of the file reads the name (a logger or a run a cell put under
# `logger = None` in a module that never reads `logger`: it changes nothing the module does; the code of
# another module that reads it is keyed by its own reads, where the key holds that code by what it does);
# where nothing differs the key is what it was, so two kernels that imported the file agree,
# and two that set the same value share an entry. Each module a keyed function reaches is compared once per
# key, the modules it imports (Note [The user's modules a module imports]) too; a transformers class
# reaches none. It runs on every key of such a call, the hit's included (about 1 us for a small module,
# 13-20 us for one of 30 names, four of them decorated); the file is parsed once per version of it.
class _Bindings(NamedTuple):
    literals: tuple[tuple[str, Any, bool], ...]  # (name, `literal_form` of its value, the file's code changes it)
    definitions: tuple[tuple[str, bool], ...]  # (name of a def or class, decorated)
    attributes: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]  # (class, its literal attributes)
    read: frozenset[str]  # the names its code reads (loads), anywhere in the file
    counters: frozenset[str]  # the names its functions change only by `X += ...` under `global X`
    outside: tuple[tuple[str, bool], ...]  # (a name it binds to what it read from the environment or a file,
    #                                       whether its functions or classes read the name)


@functools.lru_cache(maxsize=64)
def _parsed(file: str, identity: tuple[int, ...]) -> tuple[bytes, Any] | None:
    """The source of `file` (at this `identity` of it) and its syntax tree, read and parsed once for what
    it binds (`file_bindings`) and what it imports (`_imports`); None where it cannot be read or parsed."""
    import ast

    try:
        with open(file, "rb") as f:
            source = f.read()
        return source, ast.parse(source, file)
    except (OSError, SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=256)
def file_bindings(file: str, identity: tuple[int, ...]) -> _Bindings | None:
    """What the top level of `file` (at this `identity` of it) binds that a module can be compared with
    (Note [What a module holds that its file does not bind]); None where it is no Python source."""
    import ast

    parsed = _parsed(file, identity) if file.endswith(".py") else None
    if parsed is None:
        return None
    source, tree = parsed
    counts: dict[str, int] = {}
    start = 0
    for i, node in enumerate(tree.body):
        for name, n in _bound_names([node]).items():
            counts[name] = counts.get(name, 0) + n
        if "*" in counts:  # (a `*` import may bind any name bound before it)
            start, counts = i + 1, {}
    body = tree.body[start:]
    definitions, attributes = [], []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and counts[node.name] == 1:
            definitions.append((node.name, bool(node.decorator_list)))
            if isinstance(node, ast.ClassDef):
                own = _literals(node.body, _bound_names(node.body), node.name)
                if own:
                    attributes.append((node.name, own))
    found = _literals(body, counts, None)
    # (only a `global` statement rebinds, and only a list, dict or set changes in place: most files need no walk)
    walk = b"global" in source or any(_mutable(form) for _, form in found)
    state = _changed_by_code(tree) if walk else set()
    read = frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    outside_names = _read_outside(tree.body)
    later = _read_later(tree) if outside_names else frozenset()
    outside = tuple((name, name in later) for name in outside_names)
    return _Bindings(tuple((name, form, name in state) for name, form in found), tuple(definitions), tuple(attributes),
                     read, _counters(tree) if b"global" in source else frozenset(), outside)


# Note [What a module reads when it is imported]
# A module of the user's may bind a name to what it reads from outside its file when it runs: `WIDTH =
# int(os.environ.get("WIDTH", 8))`, `CFG = json.load(open("config.json"))`, `with open(...) as f: CFG =
# yaml.safe_load(f)`, `if os.getenv("BIG"): LAYERS = 24`. Its file's identity does not say what the name
# holds: a kernel started with WIDTH=16, or after the config was edited, imports the same file, and its load
# got the entry of the kernel before (a stale hit). So a name the top level of the file binds by a statement
# that reads the environment (`environ`, `getenv`) or a file (`open`, `read_text`, `read_bytes`, a `load`,
# `safe_load`, `loadtxt`, `read_csv`, ...), or reads a name bound so before it, is keyed by what the module
# holds under it now (`read_at_import`), whoever reads it (the file's functions, or another module's that
# imported it: `from settings import WIDTH`); the names of an `if`, `with`, `try`, `for` or `while` at the
# top level whose header reads so are all keyed so. A file it opened and keeps open (`VOCAB =
# open("vocab.txt")`) is keyed by that file's identity and its position where it can be read from, and left
# out where it cannot (a log it writes). A value that cannot be keyed makes the load run plainly and say
# which name holds what, where the file's functions or classes read the name; one they do not read (the
# file a `with` opened, read at the top level alone) is left out. Not seen: a value computed at import
# from anything else (`STARTED = time.time()`, `DEVICE = "cuda" if torch.cuda.is_available() else "cpu"`: a
# kernel of another run is not to be told apart by them), and what a function of the module reads when it
# runs (its own reads are the file's: keyed by the key's fingerprint of what the load reads, or not at all).
_READS_OUTSIDE = frozenset({
    "getenv", "open", "read_text", "read_bytes", "load", "loads", "safe_load", "full_load", "load_all",
    "loadtxt", "genfromtxt", "read_csv", "read_json", "read_parquet", "from_file", "from_json_file"})


def _read_outside(body: list[Any]) -> list[str]:
    """The names the statements `body` (a module's top level) bind to what they read from the environment or
    a file, or from a name bound so before (Note [What a module reads when it is imported])."""
    import ast

    found: list[str] = []
    for node in body:
        header: list[Any]
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            header = [node.value] if node.value is not None else []
        elif isinstance(node, (ast.If, ast.While)):
            header = [node.test]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            header = [item.context_expr for item in node.items]
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            header = [node.iter]
        elif isinstance(node, ast.Try):
            header = node.body  # (what it tries runs before its handlers bind anything)
        else:
            continue
        if any(_reads_outside(expr, found) for expr in header):
            found += [name for name in _bound_names([node]) if name not in found and name != "*"]
    return found


def _read_later(tree: Any) -> frozenset[str]:
    """The names the file's functions and classes read: what runs after the module's top level (a class's
    body runs with it, and keeps what it read)."""
    import ast

    return frozenset(n.id for d in ast.walk(tree)
                     if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
                     for n in ast.walk(d) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))


def _reads_outside(node: Any, found: list[str]) -> bool:
    import ast

    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and (sub.id == "environ" or sub.id in found):
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "environ":
            return True
        if isinstance(sub, ast.Call):
            called = sub.func.attr if isinstance(sub.func, ast.Attribute) else getattr(sub.func, "id", None)
            if called in _READS_OUTSIDE:
                return True
    return False


def read_at_import(mod: types.ModuleType, bound: _Bindings) -> list[tuple[str, Any, bool]]:
    """(name, what `mod` holds under it now or GONE, whether the file's functions or classes read it) for
    each name its file binds to what it read from the environment or a file when it ran (`bound`:
    `file_bindings`; Note [What a module reads when it is imported])."""
    held = vars(mod)
    return [(name, held.get(name, GONE), later) for name, later in bound.outside]


def _counters(tree: Any) -> frozenset[str]:
    """The names the file's functions declare `global` and change only by augmented assignment (`calls +=
    1`): counters of the module's own, not compared (Note [What a module holds that its file does not
    bind])."""
    import ast

    counted: set[str] = set()
    bound: set[str] = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = {n for node in ast.walk(function) if isinstance(node, ast.Global) for n in node.names}
        augmented = {id(node.target) for node in ast.walk(function) if isinstance(node, ast.AugAssign)}
        for node in ast.walk(function):
            if isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, (ast.Store, ast.Del)):
                (counted if id(node) in augmented else bound).add(node.id)
    return frozenset(counted - bound)


def _mutable(form: Any) -> bool:
    """Whether the value whose `literal_form` is `form` holds a list, a dict or a set."""
    kind, value = form
    return kind in ("list", "dict", "set") or (kind == "tuple" and any(_mutable(f) for f in value))


def _literals(body: list[Any], counts: dict[str, int], cls: str | None) -> tuple[tuple[str, Any], ...]:
    """The names `body` (a module's, or class `cls`'s) binds once, to a literal: (name, its literal form)."""
    import ast

    out = []
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name) or counts.get(target.id) != 1:
            continue
        try:
            form = literal_form(_literal_value(value, counts))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue  # computed when the file runs: not compared
        name = target.id
        if cls is not None and name.startswith("__") and not name.endswith("__") and cls.strip("_"):
            name = f"_{cls.lstrip('_')}{name}"  # as Python stores a private name of the class
        if form is not None and name not in CLASS_BOOKKEEPING:
            out.append((name, form))
    return tuple(out)


_CONTAINERS: dict[str, Any] = {"dict": dict, "list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def _literal_value(node: Any, counts: dict[str, int]) -> Any:
    """What the expression `node` evaluates to, where it is a literal (`ast.literal_eval`'s) or a builtin
    container made of literals (`dict(width=8)`, `list((1, 2))`) whose name the file does not bind; raises
    ValueError for any other."""
    import ast

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CONTAINERS \
            and node.func.id not in counts and len(node.args) <= 1 and not any(k.arg is None for k in node.keywords):
        made = _CONTAINERS[node.func.id]
        args = [ast.literal_eval(a) for a in node.args]
        keywords = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
        return made(*args, **keywords)
    return ast.literal_eval(node)


def _bound_names(body: list[Any]) -> dict[str, int]:
    """How many times the statements `body` bind each name in their own scope: assignments, imports,
    `def`, `class`, loops, `with`, `except`, `match`, `del`; not the names bound inside the functions and
    classes they define."""
    import ast

    counts: dict[str, int] = {}
    todo: list[Any] = list(body)
    while todo:
        node = todo.pop()
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            todo += node.decorator_list  # (what runs here: a `:=` there binds in this scope)
            todo += [*node.bases, *(k.value for k in node.keywords)] if isinstance(node, ast.ClassDef) else \
                [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        elif isinstance(node, ast.Lambda):
            todo += [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        elif isinstance(node, ast.AnnAssign) and node.value is None:
            pass  # an annotation alone binds nothing
        else:
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                names.append(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names += [a.asname or a.name.split(".")[0] for a in node.names]  # ("*" for a `*` import)
            elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
                names.append(node.name)
            elif isinstance(node, ast.MatchMapping) and node.rest:
                names.append(node.rest)
            else:  # changed in place here: `X[k] = v`, `X.attr = v`, `X.append(v)`
                names += _changed_in_place(node)
            todo.extend(ast.iter_child_nodes(node))
        for name in names:
            counts[name] = counts.get(name, 0) + 1
    return counts


def _changed_by_code(tree: Any) -> set[str]:
    """The names the code of a module's functions changes: rebinds (`global X`) or changes in place (Note
    [What a module holds that its file does not bind])."""
    import ast

    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.update(node.names)
        else:
            out.update(_changed_in_place(node))
    return out


# The methods of the literals' types that change them in place
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "popitem", "add",
                       "discard", "sort", "reverse", "difference_update", "intersection_update",
                       "symmetric_difference_update", "__setitem__", "__delitem__", "__iadd__", "__ior__"})


def _changed_in_place(node: Any) -> list[str]:
    """The name `node` changes in place, as `X[k] = v`, `del X[k]`, `X.a = v` or `X.append(v)` do (through
    any chain of items and attributes: `X[k].append(v)`), if it does."""
    import ast

    if isinstance(node, (ast.Subscript, ast.Attribute)) and not isinstance(node.ctx, ast.Load):
        base = node.value
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
        base = node.func.value
    else:
        return []
    while isinstance(base, (ast.Subscript, ast.Attribute)):
        base = base.value
    return [base.id] if isinstance(base, ast.Name) else []


class _NotLiteral(Exception):
    pass


_SCALAR_LITERALS = frozenset({type(None), bool, int, str, bytes, type(...)})


def literal_form(v: Any) -> Any:
    """`v` as a value to compare with a literal of a file, its types included (1, 1.0 and True differ, a
    list is not a tuple; a float by its repr, so nan is itself); None where `v` is no literal, holds more
    than _LITERAL_ITEMS values or nests deeper than _LITERAL_DEPTH levels (itself, say)."""
    t = type(v)
    if t in _SCALAR_LITERALS:  # (the common case, without the walk)
        return (t.__name__, v)
    try:
        return _form(v, 0, [0])
    except _NotLiteral:
        return None


def _form(x: Any, depth: int, count: list[int]) -> Any:
    count[0] += 1
    if count[0] > _LITERAL_ITEMS or depth > _LITERAL_DEPTH:
        raise _NotLiteral
    t = type(x)
    if t in _SCALAR_LITERALS:
        return (t.__name__, x)
    if t is float or t is complex:
        return (t.__name__, repr(x))
    if t is list or t is tuple:
        return (t.__name__, tuple(_form(y, depth + 1, count) for y in x))
    if t is dict:
        return ("dict", tuple((_form(k, depth + 1, count), _form(y, depth + 1, count)) for k, y in x.items()))
    if t is set or t is frozenset:
        return (t.__name__, frozenset(_form(y, depth + 1, count) for y in x))
    raise _NotLiteral


def defined_in(x: Any, module: str, name: str, file: str, decorated: bool) -> bool:
    """Whether `x` is the function or class `name` that `module`'s `file` defines at its top level, or, for
    a decorated one, wraps it (through `__wrapped__`, or a closure), or is a decorator's object that is no
    function or class (not compared: Note [What a module holds that its file does not bind])."""
    todo, looked = [x], 0
    while todo and looked < 16:
        y = todo.pop()
        looked += 1
        if isinstance(y, type) and y.__module__ == module and y.__qualname__ == name:
            return True
        if isinstance(y, types.FunctionType) and y.__module__ == module and y.__qualname__ == name and \
                y.__code__.co_filename == file:
            return True
        if not decorated:
            return False
        try:
            wrapped = vars(y).get("__wrapped__")
        except TypeError:  # (no __dict__)
            wrapped = None
        if wrapped is not None:
            todo.append(wrapped)
        if isinstance(y, types.FunctionType):
            todo += [cell_contents(c) for c in y.__closure__ or ()]
    return decorated and not isinstance(x, (types.FunctionType, type))


GONE = object()  # what `held_otherwise` says a module holds for a name it lost


def held_otherwise(mod: types.ModuleType, file: str, bound: _Bindings) -> list[tuple[str, Any]]:
    """(name, what `mod` holds under it now, or GONE) for each name `mod` holds otherwise than its `file`
    binds it (`bound`: `file_bindings`), "Class.attr" for a class's (Note [What a module holds that its
    file does not bind])."""
    module, held = mod.__name__, vars(mod)
    out: list[tuple[str, Any]] = []
    for name, form, its_state in bound.literals:
        if name in bound.counters:
            continue
        now = held.get(name, GONE)
        now_form = None if now is GONE else literal_form(now)
        if now_form != form and not (its_state and now_form is None):
            out.append((name, now))
    classes = []
    for name, decorated in bound.definitions:
        now = held.get(name, GONE)
        if isinstance(now, type) and now.__module__ == module and now.__qualname__ == name:
            classes.append((name, now))
        elif not (type(now) is types.FunctionType and now.__code__.co_filename == file and now.__module__ == module
                  and now.__qualname__ == name) and (now is GONE or not defined_in(now, module, name, file, decorated)):
            out.append((name, now))
    for name, made in classes:  # methods a cell put on the file's classes
        out += [(f"{name}.{attr}", now) for attr, now in replaced_methods(made, file)]
    for name, attributes in bound.attributes:
        cls = held.get(name)
        if not (isinstance(cls, type) and cls.__module__ == module and cls.__qualname__ == name):
            continue  # the class itself replaced: said above
        own = vars(cls)
        for attr, form in attributes:
            now = own.get(attr, GONE)
            now_form = None if now is GONE else literal_form(now)
            if now_form is not None and now_form != form:
                out.append((f"{name}.{attr}", now))
    return out


def replaced_methods(cls: type, file: str) -> list[tuple[str, Any]]:
    """The attributes of `cls` (a class `file` defines) that run a function written elsewhere than `file`
    (a method a cell put there: `Block.width = lambda self: 16`), with what they hold now (Note [What a
    module holds that its file does not bind]). A staticmethod's, classmethod's or property's function, and
    a wrapper's (`__wrapped__`, a decorator's closure), are looked through; code `dataclass` wrote and what
    the file binds from another module are not the cell's."""
    out = []
    for attr, value in list(vars(cls).items()):
        inner = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        functions = [f for f in (inner.fget, inner.fset, inner.fdel) if f is not None] \
            if isinstance(inner, property) else [inner]
        for fn in functions:
            found = _innermost(fn)
            if isinstance(found, types.FunctionType) and found.__code__.co_filename != file and \
                    found.__module__ in ("__main__", cls.__module__) and not _made_by_dataclass(cls, attr, found):
                out.append((attr, value))
                break
    return out


def _made_by_dataclass(cls: type, attr: str, fn: types.FunctionType) -> bool:
    """Whether `fn`, `cls.attr`, is a method `dataclass` wrote for it (compiled from a string)."""
    return "__dataclass_fields__" in vars(cls) and fn.__code__.co_filename == "<string>" and fn.__name__ == attr


def _innermost(fn: Any) -> Any:
    """The function a wrapper wraps, through `__wrapped__` (at most 8 deep); `fn` where it wraps none."""
    for _ in range(8):
        try:
            wrapped = vars(fn).get("__wrapped__")
        except TypeError:  # (no __dict__)
            return fn
        if wrapped is None:
            return fn
        fn = wrapped
    return fn


@functools.lru_cache(maxsize=1024)
def _imports(module: str, file: str, identity: tuple[int, ...]) -> tuple[str, ...]:
    """The modules the import statements of `module`'s `file` name (at this `identity` of it), resolved
    against its package (`module_files.named`): `from . import x` names the package and `package.x`."""
    import ast

    parsed = _parsed(file, identity)
    if parsed is None:
        return ()
    tree = parsed[1]
    package = module if file.endswith("__init__.py") else module.rpartition(".")[0]
    names: list[str] = []
    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names += named(package, alias.name, 0, ())
        else:
            names += named(package, node.module or "", node.level, tuple(alias.name for alias in node.names))
    return tuple(dict.fromkeys(names))


def _import_statements(body: list[Any]) -> Iterator[Any]:
    """The import statements of a module's `body` that importing it or calling its functions may run: at
    any depth (in a `try`, `with`, either branch of an `if`, a function, a class), not those an `if
    TYPE_CHECKING:` holds (never run; its `else` runs)."""
    import ast

    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            negated = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
            yield from _import_statements(node.body if negated else node.orelse)
        else:
            yield from _import_statements([c for c in ast.iter_child_nodes(node)
                                           if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case))])


def module_file(module: str) -> str | None:
    """The source file of an imported module, if it has one (a notebook's `__main__` has none)."""
    if module == "__main__":
        return None
    file = getattr(sys.modules.get(module), "__file__", None)
    return file if isinstance(file, str) and os.path.isfile(file) else None
