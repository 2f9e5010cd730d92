"""Every setting of overmind_jupyter, declared once: its name, environment variable, kind, default and
meaning (docs/design.md, "Configuration").

The kernel's side builds its traitlets from these declarations (`c.Overmind.<name>` in IPython config,
overmind_jupyter/config.py); the daemon and the Jupyter server read theirs from the environment with
`get`. README's table of settings is printed by `python -m kernel_server.settings` and checked against
these declarations by tests/test_settings.py.

# Note [Bad settings]
A bad value never stops anything. `get` reports it once, as a SettingWarning that names the variable,
the value and a valid example, and uses the default instead: import, `%load_ext` and the daemon always
start, and a bad `OVERMIND_ENABLED` leaves the cache off. A kernel that loads the extension from its
config, before any cell, shows what it reported then at its first cell (`Session` in
overmind_jupyter/extension.py). A wrong simulated device list (OVERMIND_FAKE_GPUS) is no exception:
it simulates nothing, in the kernel and in the daemon, as the warning says, so that a typo leaves a GPU
machine's real devices usable through the ledger, and a CPU one says that it has no GPU. The units ledger
is the one reader that refuses instead (`read`): a wrong GPU reserve (OVERMIND_GPU_RESERVE) answers every
units request with the message, since granting units the device does not have would be a worse surprise.

# Note [Memory limit]
The budget's default (half) and its percentages are of the memory this process may use: physical
memory, or less where the memory cgroup of the process or of one of its ancestors sets a limit
(`memory.max` of cgroup v2, `memory.limit_in_bytes` of v1). A budget above that is refused: a store that
outgrows memory is killed by the kernel's OOM killer, with every entry.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "SETTINGS",
    "GiB",
    "Setting",
    "SettingError",
    "SettingWarning",
    "get",
    "markdown_table",
    "memory_limit",
    "parse_fake_gpus",
]

GiB = 1 << 30
MAX_FAKE_GPUS = 64


class SettingError(ValueError):
    """A setting's value cannot be used; the message names it, the value and a valid example."""


class SettingWarning(UserWarning):
    """A setting's value was bad and its default is used instead (Note [Bad settings])."""


# -- kinds: each turns a value (text from the environment, or a Python value from config) into one
# the code uses, or raises ValueError saying what is wrong with it ---------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError("is neither on (1, true, yes, on) nor off (0, false, no, off)")


# A wait longer than this is as good as forever, and the longest every wait of the code can take: a
# "wait forever" such as 999999999999 s overflowed the platform's time types in the waits.
LONGEST_S = 365 * 24 * 3600.0


def seconds(value: Any) -> float:
    """600, "600", "30s", "10m" or "1.5h"; a longer one than a year waits a year (`LONGEST_S`)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", str(value).lower())
        if not m:
            raise ValueError("is not a duration (seconds, or a number with s, m or h)")
        number = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if not 0 < number < math.inf:
        raise ValueError("is not a positive duration")
    return min(number, LONGEST_S)


def gib(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("is not a number of GiB") from None
    if not 0 <= number < math.inf:
        raise ValueError("is not a non-negative number of GiB")
    return number


def directory(value: Any) -> str:
    """An absolute path (after ~ is expanded), or "" for the default."""
    text = os.fspath(value).strip() if isinstance(value, (str, os.PathLike)) else None
    if text is None:
        raise ValueError("is not a path")
    if not text:
        return ""
    path = os.path.expanduser(text)
    if not os.path.isabs(path):
        raise ValueError("is not an absolute path (the daemon runs in another directory)")
    return os.path.normpath(path)


def directory_for_files(value: Any) -> str:
    """`directory`, not naming something that is not a directory (it is made when missing)."""
    path = directory(value)
    if path and os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError("is not a directory")
    return path


def budget(value: Any) -> int:
    """Bytes: 4096, "512M", "40G", "1.5T" or "50%" of the memory this process may use (Note [Memory
    limit]); at most all of it."""
    limit, limited_by = memory_limit()
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt%]?)(?:i?b)?\s*", str(value).lower())
        if not m:
            raise ValueError("is not a size (bytes, or a number with K, M, G, T or %)")
        number, unit = float(m.group(1)), m.group(2)
        nbytes = int(limit * number / 100) if unit == "%" else int(number * 1024 ** " kmgt".index(unit or " "))
    if nbytes <= 0:
        raise ValueError("is not a positive size")
    if nbytes > limit:
        raise ValueError(f"is {nbytes / GiB:.1f} GiB, more than the {limit / GiB:.1f} GiB of memory this "
                         f"machine lets the daemon use ({limited_by})")
    return nbytes


def disk_reserve(value: Any) -> str:
    """What the store leaves free on the disk its file arenas are on: sizes ("4G") and percentages of the
    filesystem ("10%") joined by commas, the largest of them counting: "10%,3G"."""
    parts = [p.strip().lower() for p in str(value).split(",")]
    for part in parts:
        if not re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt%]?)(?:i?b)?", part):
            raise ValueError("is not a size or a percentage of the disk (4G, 10%, or both: 10%,4G)")
        if part.endswith("%") and float(part[:-1]) >= 100:
            raise ValueError("keeps the whole disk free: use less than 100%")
    return ",".join(parts)


def one_of(*choices: str) -> Callable[[Any], str]:
    def choice(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return text
    return choice


def devices(value: Any) -> str:
    """`auto` (also on, 1, ...), `off` (0, no, ...), or devices joined by commas (`cuda:0,cuda:1`, `cuda`
    for `cuda:0`, `cpu`), each once, as text."""
    text = str(value).strip().lower()
    if text == "auto" or text in _TRUE:
        return "auto"
    if text in _FALSE:
        return "off"
    named: list[str] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(?:(cpu)|cuda(?::(\d+))?)\s*", part)
        if not m:
            raise ValueError("is not auto, off, or devices joined by commas (cuda:0,cuda:1; cpu stands in for "
                             "a GPU)")
        name = "cpu" if m.group(1) else f"cuda:{int(m.group(2) or 0)}"
        if name not in named:
            named.append(name)
    return ",".join(named)


def fake_gpus(value: Any) -> str:
    """A device list as `parse_fake_gpus` reads it; "" for none."""
    text = str(value).strip()
    if text:
        parse_fake_gpus(text)
    return text


def parse_fake_gpus(text: str) -> list[float]:
    """Read a simulated device list: "2x16" is two devices of 16 GiB; "24" one of 24 GiB; "1x80,2x16"
    three. Returns the memory of each device, in GiB; ValueError says what is wrong."""
    sizes: list[float] = []
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(?:(\d+)[xX*])?(\d+(?:\.\d+)?)(?:[gG](?:i?[bB])?)?", part)
        if not m or (m.group(1) is not None and int(m.group(1)) == 0) or float(m.group(2)) <= 0:
            raise ValueError("is not a device list (COUNTxGiB, as in 2x16 for two devices of 16 GiB, or "
                             "several joined by commas, as in 1x80,2x16)")
        sizes += [float(m.group(2))] * int(m.group(1) or 1)
    if len(sizes) > MAX_FAKE_GPUS:
        raise ValueError(f"asks for {len(sizes)} devices, more than {MAX_FAKE_GPUS}")
    return sizes


# -- the declarations ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One setting. `read_by` says who reads it: "kernel" (when the extension loads or the call runs),
    "daemon" (when it starts: the kernel that starts it passes its own value), "both", or "server" (the
    Jupyter server, for the kernels it starts)."""

    name: str
    env: str
    kind: Callable[[Any], Any]
    default: Any  # a value, or a function of nothing that computes it
    shown_default: str
    example: str
    help: str
    read_by: str

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default

    def parse(self, value: Any, source: str | None = None) -> Any:
        """`value` checked and converted. A SettingError names the variable, or `source` (the config
        trait, "c.Overmind.<name>"), the value and a valid example."""
        try:
            return self.kind(value)
        except ValueError as exc:
            if source is None:
                raise SettingError(f"{self.env}={value!r} {exc}: write e.g. {self.env}={self.example}") from None
            raise SettingError(f"{source} = {value!r} {exc}: write e.g. {source} = {self.example!r}") from None

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The environment's value, or the default when the variable is unset or empty; SettingError
        for a bad one."""
        raw = (os.environ if environ is None else environ).get(self.env, "")
        return self.parse(raw) if raw.strip() else self.default_value()


def _half_of_memory() -> int:
    return memory_limit()[0] // 2


ENABLED = Setting("enabled", "OVERMIND_ENABLED", flag, False, "off", "1",
                  "turn the cache on when the extension loads", "kernel")
HOME = Setting("home", "OVERMIND_HOME", directory, "", "`$XDG_RUNTIME_DIR/overmind`, else `~/.cache/overmind`",
               "~/.cache/overmind", "the daemon's state directory (mode 0700)", "both")
BUDGET = Setting("budget", "OVERMIND_BUDGET", budget, _half_of_memory, "half of the memory limit", "50%",
                 "bytes the store may hold (`40G`, `50%` of the memory limit: physical memory, or the cgroup's "
                 "where it is lower)", "daemon")
WAIT_TIMEOUT = Setting("wait_timeout", "OVERMIND_WAIT_TIMEOUT", seconds, 600.0, "600", "10m",
                       "seconds (or `10m`, `1h`) to wait for another kernel's load of the same model", "kernel")
ARENA = Setting("arena", "OVERMIND_ARENA", one_of("auto", "memfd", "file"), "auto", "`auto`", "file",
                "backing of new entries: an unnamed `file` on disk (page cache: large pages, the fastest hits, "
                "written back to disk once), a sealed `memfd` (shmem), or `auto`: the file where the arena "
                "directory is on a disk filesystem, else the memfd (and the memfd for a miss whose dtype conversions "
                "transformers makes, which fills it faster: Note [Staged conversions])", "kernel")
ARENA_DIR = Setting("arena_dir", "OVERMIND_ARENA_DIR", directory_for_files, "",
                    "the state directory, or `~/.cache/overmind/arenas` when that is a tmpfs", "/scratch/overmind",
                    "where file arenas live; they have no name and vanish with their entry", "both")
DISK_RESERVE = Setting("disk_reserve", "OVERMIND_DISK_RESERVE", disk_reserve, "10%,3g", "10% of the disk or 3 GiB, "
                      "the larger", "20%,8G",
                      "what the cache leaves free on the disk its file arenas are on: it evicts, then loads run "
                      "plainly, before the disk's free space falls below this", "daemon")
POPULATE = Setting("populate", "OVERMIND_POPULATE", flag, True, "on", "0",
                   "map a hit's pages ahead of the first forward, in the background", "kernel")
COMPACT = Setting("compact", "OVERMIND_COMPACT", flag, True, "on", "0",
                  "let the daemon copy an entry that still refers to its checkpoint files into an arena of its "
                  "own (faster hits; off keeps one copy of the weights in memory instead)", "daemon")
FAKE_GPUS = Setting("fake_gpus", "OVERMIND_FAKE_GPUS", fake_gpus, "", "none", "2x16",
                    "simulated devices for the units ledger, COUNTxGiB joined by commas", "both")
GPU_RESERVE = Setting("gpu_reserve", "OVERMIND_GPU_RESERVE", gib, 1.0, "1", "0.5",
                      "GiB of each device kept out of the ledger (allocator slack; kernels' CUDA contexts are "
                      "held apart)", "daemon")
UNITS_TIMEOUT = Setting("units_timeout", "OVERMIND_UNITS_TIMEOUT", seconds, 600.0, "600", "2m",
                        "seconds `units.place` waits for units held by busy models elsewhere", "kernel")
WARM = Setting("warm", "OVERMIND_WARM", flag, True, "on", "0",
               "start kernels of the overmind kernelspec forked from a warm spare (`c.WarmProvisioner.enabled` "
               "in the server's config)", "server")
WARM_DEVICES = Setting("warm_devices", "OVERMIND_WARM_DEVICES", devices, "auto", "`auto`", "cuda:0,cuda:1",
                       "devices a warm kernel started ahead readies while it waits for the restart: its CUDA "
                       "context and cuBLAS handles (`auto`: the first visible CUDA device, when torch is "
                       "preloaded and CUDA is available; `off`; or a list; `cpu` runs the same steps on the CPU: "
                       "Note [Devices warmed ahead])", "kernel")

DEVICE_COPIER = Setting("device_copier", "OVERMIND_DEVICE_COPIER", one_of("auto", "off", "cpu"), "auto", "`auto`",
                        "off", "how a cached model moves to a GPU: `auto` through the per-user device copier (a "
                        "device copy, else pinned staging), `off` with torch's own copy from pageable memory; `cpu` "
                        "also fills simulated devices (OVERMIND_FAKE_GPUS) on the CPU, a stand-in for tests",
                        "kernel")

DEVICE_COPY_IDLE = Setting("device_copy_idle", "OVERMIND_DEVICE_COPY_IDLE", seconds, 900.0, "900", "1h",
                           "seconds the device copier keeps a copy of an entry on a GPU that no kernel has moved "
                           "since (GPU memory other programs may want; kernels get theirs back from it at once)",
                           "kernel")

SETTINGS: tuple[Setting, ...] = (ENABLED, HOME, BUDGET, WAIT_TIMEOUT, ARENA, ARENA_DIR, DISK_RESERVE, POPULATE, COMPACT,
                                 FAKE_GPUS, GPU_RESERVE, UNITS_TIMEOUT, WARM, WARM_DEVICES, DEVICE_COPIER,
                                 DEVICE_COPY_IDLE)

_reported: set[str] = set()


def report(error: SettingError, setting: Setting) -> None:
    """Warn once per message that a bad value is replaced by the default (Note [Bad settings])."""
    message = f"{error}; using the default ({setting.shown_default.replace('`', '')}) meanwhile"
    if message not in _reported:
        _reported.add(message)
        # No source line: where in our code the value was read is of no use to whoever set it.
        warnings.warn_explicit(message, SettingWarning, filename="overmind settings", lineno=0)


def get(setting: Setting, environ: Mapping[str, str] | None = None) -> Any:
    """`setting`'s value from the environment; its default, reported once, when that value is bad."""
    try:
        return setting.read(environ)
    except SettingError as exc:
        report(exc, setting)
        return setting.default_value()


# -- memory (Note [Memory limit]) --------------------------------------------------------------------

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def memory_limit(proc: Path = Path("/proc/self")) -> tuple[int, str]:
    """Bytes of memory this process may use, and what sets that: "physical memory", or "the memory
    limit of cgroup PATH"."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cgroup = cgroup_memory_limit(proc)
    if cgroup is not None and cgroup[0] < physical:
        return cgroup[0], f"the memory limit of cgroup {cgroup[1]}"
    return physical, "physical memory"


def cgroup_memory_limit(proc: Path = Path("/proc/self")) -> tuple[int, str] | None:
    """The lowest memory limit set on the process's memory cgroup or its ancestors, with the directory
    that sets it; None when there is none (or no cgroup filesystem to read)."""
    found = [limit for mount_point, directory, name in memory_cgroups(proc)
             for limit in _limits_up_to(mount_point, directory, name)]
    return min(found) if found else None


def memory_cgroups(proc: Path = Path("/proc/self")) -> list[tuple[Path, Path, str]]:
    """(mount point, directory, name of its limit file) of the process's memory cgroup in each mounted
    hierarchy (v1's memory controller, v2's unified one)."""
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in memberships:
        hierarchy, controllers, path = line.split(":", 2)
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for root, mount_point in _cgroup_mounts(mounts, v2):
            inside = os.path.relpath(path, root)
            if not inside.startswith(".."):
                out.append((Path(mount_point), Path(mount_point) / inside,
                            "memory.max" if v2 else "memory.limit_in_bytes"))
    return out


def _cgroup_mounts(mountinfo: list[str], v2: bool) -> list[tuple[str, str]]:
    """(root inside the hierarchy, mount point) of each mount of the memory hierarchy."""
    out = []
    for line in mountinfo:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, super_options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        if (fstype == "cgroup2") if v2 else (fstype == "cgroup" and "memory" in super_options.split(",")):
            out.append((fields[3], fields[4]))
    return out


def _limits_up_to(top: Path, directory: Path, name: str) -> list[tuple[int, str]]:
    limits = []
    while True:
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            text = "max"
        if text.isdigit() and int(text) < _UNLIMITED:
            limits.append((int(text), str(directory)))
        if directory == top or top not in directory.parents:
            return limits
        directory = directory.parent


# -- README's table ------------------------------------------------------------------------------

_READ_BY = {"kernel": "kernel", "daemon": "daemon, when it starts", "both": "kernel and daemon",
            "server": "Jupyter server"}


def markdown_table() -> str:
    rows = ["| setting | environment | default | read by | what it does |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        trait = f"`{s.name}`" if s.read_by != "server" else ""
        rows.append(f"| {trait} | `{s.env}` | {s.shown_default} | {_READ_BY[s.read_by]} | {s.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
