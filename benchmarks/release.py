"""The way back from a device (Note [Lazy release to the cached weights]): comparing a model's tensors with
the cached host tensors, against copying them back, for a 7B Llama's shapes in bf16.

Without a GPU the "device" is the CPU, as in the tests (`to_device(model, "cpu", copy=True)`): each
device tensor is a private CPU copy of its host tensor. Cases, interleaved in each round:
  compare        `Reader.same_bytes` of every tensor with its host tensor, all equal: what a release of
                 an unchanged model costs (the host tensors come back, nothing new is written)
  copy back      `t.to("cpu", copy=True)` of every tensor into fresh memory: what a release costs when
                 it copies everything back (the cost of deciding nothing), and what a written tensor costs
  changed        the last byte of every tensor differs: the comparison reads it all, then copies it
A 7B model (13.5 GB of bf16) does not fit twice in this machine's memory, so the benchmark takes the
embeddings, the head and --layers of its 32 decoder layers, and scales the time by bytes.

    .venv/bin/python benchmarks/release.py
    .venv/bin/python benchmarks/release.py --layers 8 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402 (after the repository is put on the path)

from overmind_jupyter.units.transfer import Reader  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 4096, 11008, 32000, 32  # Llama-2-7B


def shapes(layers: int) -> list[tuple[int, ...]]:
    """The weights' shapes: embeddings, `layers` decoder layers, the final norm and the head."""
    layer = [(HIDDEN, HIDDEN)] * 4 + [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)] + [(HIDDEN,)] * 2
    return [(VOCAB, HIDDEN), *layer * layers, (HIDDEN,), (VOCAB, HIDDEN)]


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.nelement() * t.element_size() for t in ts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 32 (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported (default 3)")
    args = parser.parse_args()

    hosts = [torch.empty(s, dtype=torch.bfloat16).fill_(0.5 + i) for i, s in enumerate(shapes(args.layers))]
    devices = [t.clone() for t in hosts]  # the stand-in device's tensors
    size = nbytes(hosts)
    full = nbytes([torch.empty(s, dtype=torch.bfloat16, device="meta") for s in shapes(LAYERS)])

    def compare() -> None:
        reader = Reader()
        assert all(reader.same_bytes(t, h) for t, h in zip(devices, hosts, strict=True))

    def copy_back() -> None:
        for t in devices:
            t.to("cpu", copy=True)  # into fresh memory each time, as a copy the model keeps would be

    def changed() -> None:
        reader = Reader()
        for t, h in zip(devices, hosts, strict=True):
            assert not reader.same_bytes(t, h)
            t.to("cpu", copy=True)

    cases = {"compare": compare, "copy back": copy_back, "changed": changed}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeat):
        for name, case in cases.items():
            if name == "changed":
                for t in devices:
                    t.view(-1)[-1] += 1
            started = time.perf_counter()
            case()
            times[name].append(time.perf_counter() - started)
            if name == "changed":
                for t, h in zip(devices, hosts, strict=True):
                    t.copy_(h)

    print(f"release of a 7B Llama's bf16 weights ({full / 1e9:.1f} GB): {len(hosts)} tensors, "
          f"{size / 1e9:.2f} GB measured (embeddings, head, {args.layers} of {LAYERS} layers) and scaled; "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<12}{'GB/s':>8}{'7B model, s':>14}{'x copy back':>14}")
    results = {}
    copy_s = statistics.median(times["copy back"]) * full / size
    for name, ts in times.items():
        median = statistics.median(ts)
        seconds = median * full / size
        results[name] = {"median_s": median, "gb_per_s": size / median / 1e9, "model_7b_s": seconds,
                         "all_s": ts}
        print(f"{name:<12}{size / median / 1e9:>8.2f}{seconds:>14.2f}{seconds / copy_s:>14.2f}")
    OUT.mkdir(exist_ok=True)
    doc = {"results": results, "measured_bytes": size, "model_bytes": full, "args": vars(args),
           "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "load_average": os.getloadavg()[0], "torch": torch.__version__,
                       "python": platform.python_version(), "platform": platform.platform()}}
    (OUT / "release.json").write_text(json.dumps(doc, indent=2))
    print(f"wrote {OUT / 'release.json'}")


if __name__ == "__main__":
    main()
