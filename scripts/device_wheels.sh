#!/usr/bin/env bash
# Fill .whl/ with the cp312 manylinux wheels a lent GPU machine (nvidia-h200) lacks for this project's GPU
# checks: dill (a miss pickles with it), traitlets (`enable()` reads its settings with it), diffusers (a GPU
# test places a pipeline), and what a warm kernel needs there
# (ipykernel, jupyter_client, IPython, traitlets and their own needs). The device has torch, transformers,
# accelerate, peft, safetensors, psutil, pygments, packaging, python-dateutil and typing-extensions already
# (the device tool's list of the machine's packages), and no package registry: `benchmarks/gpu_run.sh` installs these with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
#
# Versions are those of the lock (scripts/locks/py3.*.txt), so the device runs what the suite passed with.
# .whl/ is ignored through .git/info/exclude (added here if missing); wheels are never committed.
#
#     scripts/device_wheels.sh            # then: du -sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=${LOCK:-$(ls scripts/locks/py3.*.txt | grep -v torch | sort -V | tail -1)}
# What a kernel started by jupyter_client on the device imports, beyond what the device has.
NAMES=(dill ipykernel jupyter-client jupyter-core ipython ipython-pygments-lexers traitlets tornado pyzmq comm
       debugpy matplotlib-inline jedi parso pexpect ptyprocess prompt-toolkit wcwidth stack-data
       asttokens executing pure-eval platformdirs nest-asyncio2 diffusers importlib-metadata lazy-importer)
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
mkdir -p .whl
PIP=${PIP:-python3 -m pip}
for name in "${NAMES[@]}"; do
    version=$(grep -i "^${name}==" "$LOCK" | head -1 | cut -d= -f3 || true)
    if [ -z "$version" ]; then
        echo "$name is not in $LOCK: not needed by this lock's versions, skipped"
        continue
    fi
    if ls .whl | grep -iq "^$(echo "$name" | tr - _)-${version}-"; then
        continue  # already here
    fi
    $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_5_x86_64 -d .whl "$name==$version"
done
# One version of each: two stop the whole install there.
dupes=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr A-Z a-z | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "more than one wheel of: $dupes (remove the older from .whl/)" >&2
    exit 1
fi
# Every need of a carried wheel (its markers read for CPython 3.12 on Linux) is carried or on the device
# (KINDS.md's list).
python3 - <<'PY'
import glob, re, zipfile
try:
    from packaging.markers import Marker
except ImportError:
    from pip._vendor.packaging.markers import Marker
# The part of KINDS.md's list of the device's packages that these wheels name.
ON_DEVICE = {"psutil", "pygments", "packaging", "python-dateutil", "typing-extensions", "six", "setuptools",
             "filelock", "huggingface-hub", "numpy", "regex", "requests", "safetensors", "pillow", "zipp",
             "torch", "transformers", "accelerate", "peft", "tqdm", "pyyaml", "fsspec", "httpx"}
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "platform_machine": "x86_64", "extra": ""}
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
wheels = sorted(glob.glob(".whl/*.whl"))
carried = {norm(w.split("/")[-1].split("-")[0]) for w in wheels}
missing = []
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req, _, marker = line.split(":", 1)[1].partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(ENV):
            continue
        name = norm(re.match(r"\s*([A-Za-z0-9_.-]+)", req).group(1))
        if name not in carried | ON_DEVICE:
            missing.append(f"{w.split('/')[-1]} needs {name}")
if missing:
    raise SystemExit("needed, neither carried nor on the device:\n  " + "\n  ".join(missing))
print(f"every need of the {len(wheels)} wheels is carried or on the device")
PY
echo "$(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
