"""What following a load's draws costs (Note [Replayed draws] in overmind_jupyter/draws.py): PEFT's
loaders run under `draws.following` on their first miss, so every new adapter's miss pays it.

    .venv/bin/python benchmarks/following.py [SIZE] [ROUNDS] [RANK]     # 1.1b 10 4

In one warm process, rounds of `PeftModel.from_pretrained` of an all-linear rank-RANK adapter onto a
fresh plain load of the base: plainly, then under `draws.following()`. Both go through the same
library code; only the following differs. Prints the lowest and the lower quartile of each (on a VM
that hands freed memory back to its host, some rounds of either take 2-3 x: the quartile leaves them
out), the ratio, and the time in `Draws.follow` itself. The base is benchmarks/load.py's (built there
on first use), the adapter replayed_draws.py's.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from benchmarks.replayed_draws import base_and_adapter
    from overmind_jupyter import draws

    size, rounds, rank, base, adapter = base_and_adapter(10)
    follow = draws.Draws.follow
    in_follow: list[float] = []

    def timed_follow(self: draws.Draws, *args: object) -> None:
        start = time.perf_counter()
        try:
            follow(self, *args)  # type: ignore[arg-type]
        finally:
            in_follow.append(time.perf_counter() - start)

    draws.Draws.follow = timed_follow  # type: ignore[method-assign]
    cases = {"plain": contextlib.nullcontext, "following": draws.following}
    times: dict[str, list[float]] = {case: [] for case in cases}
    follows: list[float] = []
    for _ in range(rounds + 1):  # the first round left out: its imports and first calls
        for case, context in cases.items():
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            in_follow.clear()
            start = time.perf_counter()
            with context():
                model = PeftModel.from_pretrained(model, str(adapter))
            times[case].append(time.perf_counter() - start)
            if case == "following":
                follows.append(sum(in_follow))
            del model

    def low(values: list[float]) -> tuple[float, float]:
        values = sorted(values[1:])
        return values[0] * 1e3, values[len(values) // 4] * 1e3

    print(f"PeftModel.from_pretrained, {size} base, all-linear rank {rank} adapter, one process, {rounds} rounds")
    for case in cases:
        lowest, quartile = low(times[case])
        print(f"  {case:<10} lowest {lowest:7.1f} ms   lower quartile {quartile:7.1f} ms")
    print(f"  following / plain (lower quartiles): {low(times['following'])[1] / low(times['plain'])[1]:.3f}")
    print(f"  in Draws.follow: lowest {low(follows)[0]:.1f} ms, lower quartile {low(follows)[1]:.1f} ms "
          f"({len(in_follow)} operations)")


if __name__ == "__main__":
    main()
