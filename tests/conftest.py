"""Fixtures shared by the suite: an isolated daemon per test, tiny real checkpoints, subprocess helpers.

Everything here is real: the daemon is a separate process started the way a kernel starts it, and the
models are saved with `save_pretrained` and loaded by the libraries' own code.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The suite is the package `tests` (pytest puts the repository's root first on sys.path); every process a
# test starts (snippets, kernels, workers) imports its helpers the same way, as `tests.helpers.*`. No
# directory of the suite itself goes on the path: its modules would hide installed ones (test_shadowing.py).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The daemons the suite starts keep 1 GiB of the disk free, not the default's 10% (Note [Disk room]): on a
# large disk that is mostly full, 10% can exceed what is free, and every test's load would run plainly.
os.environ.setdefault("OVERMIND_DISK_RESERVE", "1G")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# The files that take longest, longest first (per-file sums of a full run's `--durations=0`). `make test` runs
# whole files on each worker in the order collected (--no-loadscope-reorder; xdist's own order is by the
# number of tests), so the long ones start first and the short ones fill in at the end: with the long ones
# last, one worker ran alone for the run's last 50-65 s. A file left out runs after these, in its place.
LONGEST_FIRST = [
    "test_never_stale.py", "test_atomic_miss_large.py", "test_rebuild.py", "test_notebooks.py", "test_extension.py",
    "test_warm.py", "test_loaders.py", "test_panel_browser.py", "test_fuzz.py", "test_atomic_miss.py",
    "test_gpu_benchmark.py", "test_views_browser.py", "test_staging.py", "test_replayed_draws.py", "test_progress.py",
    "adapters/test_adapter_generation_settings.py", "adapters/test_adapter_concurrency.py", "test_descriptors.py",
    "test_widgets_browser.py", "test_notebook_loaders.py", "test_demo.py", "test_copier.py", "test_widgets.py",
    "test_helper_threads.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {f"tests/{name}": i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: in-file order kept
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_adapter_gate_left_open() -> Iterator[None]:
    """Each test closes the adapter gates it opened (after its own fixtures' teardown, which may close
    them). A gate left open keeps its guards patched on PEFT's classes until the collector finds it, and
    a later test of those patches on the same worker failed, depending on which files ran there before."""
    yield
    gating = sys.modules.get("overmind_jupyter.adapters.gating")
    left = gating.open_gates() if gating is not None else []
    named = [repr(gate) for gate in left]
    for gate in left:
        gate.close()
    assert not named, f"the test left adapter gates open: {named}"


def stop_daemon(home: Path) -> None:
    """Stop the daemon of `home` by its pid (graceful first), and wait until it is gone."""
    from kernel_server.lifecycle import kill_daemon

    kill_daemon(home)


@pytest.fixture
def overmind_home(monkeypatch: pytest.MonkeyPatch):
    """A fresh OVERMIND_HOME (short, for the socket path limit) for this test and its subprocesses;
    the daemon started there is stopped at the end, and this process's connection is dropped."""
    from kernel_server.client import reset_shared_client

    home = Path(tempfile.mkdtemp(prefix="om-", dir="/tmp"))
    os.chmod(home, 0o700)
    monkeypatch.setenv("OVERMIND_HOME", str(home))
    reset_shared_client()
    if "overmind_jupyter.loading" in sys.modules:
        sys.modules["overmind_jupyter.loading"].clear_fallbacks()
    yield home
    reset_shared_client()
    stop_daemon(home)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def daemon(overmind_home: Path):
    """A running daemon on `overmind_home`; yields a client connected to it."""
    from kernel_server import Client

    client = Client(overmind_home, role="test")
    yield client
    client.close()


@pytest.fixture
def copier_up(overmind_home: Path):
    """`copier_up()` starts the daemon of `overmind_home`, then the device copier, and connects this process
    to it; it returns a test client (`copier_up(copier=False)`: the daemon only). A test's first move of a
    cached model then fills through the copier (Note [Filling a model on a device] in
    overmind_jupyter/units/filling.py): with no copier up, that move goes torch's way and starts one, with a
    notice the suite's warning filter makes an error (told once per process, so which test met it depended
    on the order). The daemon and the copier get the environment the test set before the call
    (OVERMIND_FAKE_GPUS, OVERMIND_DEVICE_COPIER). The copier is killed at the end if still there."""
    import signal

    from kernel_server import Client

    clients: list[Client] = []

    def start(*, copier: bool = True) -> Client:
        from overmind_jupyter.units import filling

        clients.append(Client(overmind_home, role="test"))
        if copier and filling.connect(wait=120) is None:
            log = overmind_home / "copier.log"
            raise AssertionError(f"no device copier answered in 120 s: {log.read_text() if log.exists() else ''}")
        return clients[-1]

    yield start
    if not clients:
        return
    from overmind_jupyter.units import filling

    state = filling.state()
    filling.disconnect()  # this process's connection to the copier of a home that goes with the test
    for c in clients:
        c.close()
    if state is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(state["pid"]), signal.SIGKILL)


@pytest.fixture
def gpu_copier(copier_up, monkeypatch: pytest.MonkeyPatch):
    """For a test marked gpu that moves a cached model to the device: the daemon and the device copier up
    first (`copier_up`), on the real devices; yields a test client."""
    monkeypatch.delenv("OVERMIND_FAKE_GPUS", raising=False)
    monkeypatch.setenv("OVERMIND_DEVICE_COPIER", "auto")
    return copier_up()


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A gate (tests/helpers/faults_helpers.py) that gated loaders in this test and its processes wait at;
    opened at the end."""
    from tests.helpers.faults_helpers import Gate

    g = Gate(tmp_path / "gate")
    monkeypatch.setenv("FAULTS_GATE", str(g.path))
    yield g
    g.open()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_dir: Path) -> Path:
    from overmind_jupyter.demo_models import build_llama

    return build_llama(models_dir / "tiny-llama", "tiny", tie_word_embeddings=True)
