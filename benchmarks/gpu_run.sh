#!/usr/bin/env bash
# The one command a session lent a GPU passes to the device `run` tool (issue 36): the GPU tests, then
# benchmarks/gpu.py, in one call of at most ~8 minutes (a machine's start adds 1-2; the session has 15 in all,
# so a --quick rerun still fits). Before it, in the checkout the session was started in (the device tool sends
# that one): scripts/device_wheels.sh (the wheels the device lacks, into .whl/, ~20 MiB). Then:
#
#     run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=600)
#
# What comes back under $OUT: gpu.json (the benchmark's report) and gpu.txt (its table), gpu.log,
# pytest-gpu.log, machine.txt. The end of the output is the benchmark's table. gpu.py writes gpu.json and
# gpu.txt as each size ends, and on the SIGTERM of its `timeout` (what ran until then; SIGKILL 30 s later).
# GPU_ARGS passes options to gpu.py, GPU_TESTS=0 skips the tests:
# a rerun on the still-warm machine is `GPU_TESTS=0 GPU_ARGS=--quick bash benchmarks/gpu_run.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
else
    echo "no .whl/: dill, traitlets, ipykernel ... are missing there; run scripts/device_wheels.sh and carry .whl"
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'transformers', transformers.__version__, 'available', torch.cuda.is_available())"
  df -h /dev/shm /tmp | tail -2; nproc; free -g | head -2; } 2>&1 | tee "$OUT/machine.txt"
# The tests marked gpu (they skip without a device); 120 s at most.
[ "${GPU_TESTS:-1}" = 0 ] || timeout -k 10 120 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -ra \
    tests/test_units.py tests/test_placement.py tests/test_extension.py tests/test_copier.py 2>&1 | tee "$OUT/pytest-gpu.log"
# The benchmark: 1.1B and 7B (gpu.py's --budget skips what would not fit, and says so).
timeout -k 30 350 python3 benchmarks/gpu.py --budget 320 --out "$OUT/gpu.json" ${GPU_ARGS:-} 2>&1 | tee "$OUT/gpu.log"
