"""Host time per decode step of the penalties' counts (CPU machine; not a timed test, not part of `nox -s bench`).

32 presence-penalized rows, each with 512 / 2,048 / 8,192 output tokens, one token appended to each between two
steps. Compares, per step:
- rebuild: what `penalties` did before the count table: each row's whole output made an array, range-checked,
  concatenated and copied to the device, then scatter_added into a fresh [rows, vocab] table;
- table:   `PenaltyCounts.step`, the rows' slots kept between steps and given only their new tokens;
- and the whole `adjusted_logits` of the step (the penalty arithmetic over [rows, vocab] included) on the table.
At the model's vocabulary (151,936) the CPU's time is mostly the [rows, vocab] memory both paths write (a fresh
zeroed table, or the gathered rows); at a small vocabulary it is the host work the GPU waits for.

    PYTHONPATH=src python bench/host_penalties.py [rows]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from prism.engine.penalties import TokenHistory, adjusted_logits  # noqa: E402
from prism.engine.penalty_counts import CountsSlot, PenaltyCounts  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.ops import host_copy  # noqa: E402

STEPS = 40


def rebuilt_counts(histories: list[TokenHistory], vocab: int) -> torch.Tensor:
    """The counts as the full rebuild made them every step."""
    outputs = []
    for j, h in enumerate(histories):
        ids = np.asarray(h.output, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError("out of the vocabulary")
        outputs.append(ids + j * vocab)
    at = host_copy.to_device(np.concatenate(outputs), "cpu", torch.int64)
    counts = torch.zeros(len(histories) * vocab, dtype=torch.int32)
    counts.scatter_add_(0, at, torch.ones(1, dtype=torch.int32).expand(len(at)))
    return counts.view(len(histories), vocab)


def per_step_ms(step, outputs: list[list[int]], vocab: int, rng: np.random.Generator) -> float:
    step()  # a first step: the table's slots are filled from the whole histories here, once per request
    start = time.perf_counter()
    for _ in range(STEPS):
        for out in outputs:
            out.append(int(rng.integers(vocab)))
        step()
    return (time.perf_counter() - start) / STEPS * 1e3


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    torch.set_num_threads(1)
    params = [SamplingParams(presence_penalty=1.5)] * rows
    print(f"{rows} presence-penalized rows, one new token per row per step; ms of host time per step (CPU)")
    print(f"{'vocab':>8} {'output tokens':>14} {'rebuild':>9} {'table':>9} {'adjusted_logits (table)':>24}")
    for vocab in (1024, 151_936):
        logits = torch.randn(rows, vocab)
        for length in (512, 2048, 8192):
            rng = np.random.default_rng(length)
            outputs = [rng.integers(vocab, size=length).tolist() for _ in range(rows)]
            plain = [TokenHistory((), out) for out in outputs]
            old = per_step_ms(lambda h=plain, v=vocab: rebuilt_counts(h, v), outputs, vocab, rng)
            table, slots = PenaltyCounts("cpu", vocab, slots=rows), [CountsSlot() for _ in range(rows)]
            kept = [TokenHistory((), out, slot) for out, slot in zip(outputs, slots, strict=True)]
            extra = np.empty(0, dtype=np.int64)
            new = per_step_ms(lambda h=kept, t=table, e=extra: t.step(h, [False] * rows, e), outputs, vocab, rng)
            whole = per_step_ms(lambda h=kept, t=table, x=logits: adjusted_logits(x, params, h, t), outputs, vocab, rng)
            for slot, out in zip(slots, outputs, strict=True):
                assert torch.equal(table.counts[slot.index], torch.bincount(torch.tensor(out), minlength=vocab).int())
            print(f"{vocab:>8} {length:>14,} {old:>9.3f} {new:>9.3f} {whole:>24.3f}")


if __name__ == "__main__":
    main()
