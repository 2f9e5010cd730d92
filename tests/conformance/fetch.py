"""Fetch the test suites of peft, transformers and diffusers for the conformance run.

    .venv/bin/python tests/conformance/fetch.py      # idempotent; offline once everything is there

For each library, the source distribution of exactly the installed version is downloaded with pip
(`pip download --no-deps --no-binary :all: NAME==VERSION`) into `.conformance-cache/sdists/`, and only its
`tests/` tree is unpacked, into `.conformance-cache/NAME-VERSION/tests/`. The sdists ship their tests
without `tests/__init__.py`, which their test modules need (they import each other relatively): an empty
one is written. The packages the libraries' tests import that this project does not install (`datasets`,
`parameterized`, ...) are installed, at the versions pinned in `selection.py`, into
`.conformance-cache/site/`, which only the conformance run puts on its path; the project's `.venv` is not
changed. Everything fetched is recorded in `.conformance-cache/NAME-VERSION/SOURCE.json`; a second run
that finds it complete asks no registry.

What the sdists hold (see selection.py): peft's has its whole test suite; transformers' only the common
mixins (`tests/*.py`, not `tests/models/...`); diffusers' only `tests/testing_utils.py`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import selection  # noqa: E402

CACHE = Path(os.environ.get("OVERMIND_CONFORMANCE_CACHE", REPO / ".conformance-cache"))


def installed_version(name: str) -> str:
    return importlib.metadata.version(name)


def tree(name: str, version: str | None = None) -> Path:
    """Where the unpacked tests of `name` (at the installed version) live: its `tests/` is below."""
    return CACHE / f"{name}-{version or installed_version(name)}"


def site_dir() -> Path:
    return CACHE / "site"


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def _download_sdist(name: str, version: str) -> Path:
    sdists = CACHE / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    for candidate in sdists.glob(f"{name}-{version}.tar.gz"):
        return candidate
    with tempfile.TemporaryDirectory(dir=sdists) as tmp:
        args = ["download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", tmp, f"{name}=={version}"]
        # pip prepares the sdist's metadata; with setuptools in this environment that needs no download
        if importlib.util.find_spec("setuptools") is not None:
            args.insert(1, "--no-build-isolation")
        _pip(*args)
        found = [p for p in Path(tmp).iterdir() if p.name.endswith(".tar.gz")]
        if len(found) != 1:
            raise SystemExit(f"pip download {name}=={version} gave {[p.name for p in Path(tmp).iterdir()]}, "
                             "not one .tar.gz sdist")
        target = sdists / found[0].name
        found[0].replace(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _unpack_tests(name: str, version: str, sdist: Path) -> dict[str, object]:
    root = tree(name, version)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))
    prefix = None
    count = 0
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            top, _, rest = member.name.partition("/")
            prefix = prefix or top
            if not rest.startswith("tests/") or not (member.isfile() or member.isdir()):
                continue
            target = staging / rest
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            target.write_bytes(source.read())
            count += 1
    tests = staging / "tests"
    if count == 0:
        shutil.rmtree(staging)
        raise SystemExit(f"the sdist {sdist.name} has no tests/ directory")
    added_init = not (tests / "__init__.py").exists()
    if added_init:
        (tests / "__init__.py").write_text("# written by overmind_jupyter's tests/conformance/fetch.py: the sdist "
                                           "ships none, and its test modules import each other relatively\n")
    source_record = {
        "name": name,
        "version": version,
        "sdist": sdist.name,
        "sha256": _sha256(sdist),
        "files": count,
        "test_modules": sorted(p.relative_to(staging).as_posix() for p in tests.rglob("test_*.py")),
        "added_init": added_init,
    }
    (staging / "SOURCE.json").write_text(json.dumps(source_record, indent=1) + "\n")
    if root.exists():
        shutil.rmtree(root)
    staging.replace(root)
    return source_record


def fetch_library(name: str) -> dict[str, object]:
    version = installed_version(name)
    root = tree(name, version)
    record_path = root / "SOURCE.json"
    if record_path.exists():
        return json.loads(record_path.read_text())
    sdist = _download_sdist(name, version)
    return _unpack_tests(name, version, sdist)


def fetch_requirements() -> None:
    """The libraries' test requirements that .venv lacks, into .conformance-cache/site (no deps: what they
    need besides is in .venv already, and nothing there is shadowed)."""
    site = site_dir()
    marker = site / ".requirements"
    wanted = "\n".join(selection.TEST_REQUIREMENTS) + "\n"
    if marker.exists() and marker.read_text() == wanted:
        return
    if site.exists():
        shutil.rmtree(site)
    _pip("install", "--quiet", "--no-deps", "--target", str(site), *selection.TEST_REQUIREMENTS)
    marker.write_text(wanted)


def fetch_all() -> dict[str, dict[str, object]]:
    CACHE.mkdir(parents=True, exist_ok=True)
    records = {name: fetch_library(name) for name in selection.LIBRARIES}
    fetch_requirements()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    for name, record in fetch_all().items():
        modules = record["test_modules"]
        assert isinstance(modules, list)
        print(f"{name} {record['version']}: {record['sdist']}, {record['files']} files under tests/, "
              f"{len(modules)} test modules -> {tree(name)}")
    print(f"test requirements: {site_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
