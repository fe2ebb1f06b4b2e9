"""CUDA graphs of the vision encoder, one per list of item grids that keeps coming back.

Owns replaying the vision encoder without its host cost. Encoding 8 images of 448x448 is ~14 ms of GPU work
issued by ~21 ms of Python on the H200's host (27 blocks of a dozen launches each: W1's profile, session 8), so
the device waited on the host. The encoder's shapes depend only on the items' grids, and it reads no value of
the device on the host (the grid metadata is computed on the host from the grid list), so a graph captured for a
grid list replays for any pixels of that list: the same sizes of images, new pictures (W1, W4's injections).

- A grid list is captured the `capture_after`-th time it is encoded, so a one-off size never pays a capture;
  at most `max_graphs` lists are held, the least recently used one dropped with its memory. A capture takes
  ~50-60 ms of its step on the H200, so it waits for a step that does not also decode (running streams would
  wait that long for a token): a due list stays eager, with no per-shape plan, until such a step encodes it, or
  until it has been encoded `2 * capture_after` times (a list that keeps coming back in a server that never
  stops decoding is worth one stall: eager, the encoder is host-bound, ~1.5x its replay).
- The pixels are copied into the graph's input buffer, and the features cloned out of its output buffers at
  once: the encoder cache keeps them beyond the next replay.
- The graphs share one memory pool (made for them by the runner): replays run one at a time (on the main
  stream, or on the side stream ordered after and before it: `background_encoding.py`) and nothing reads a
  graph's buffers after its replay but the clone, so one list's activations may reuse another's.
- A capture that fails is logged, and that grid list stays eager; one that ran out of memory is tried again
  after `capture_after` more encodings of the list.
- A capture keeps PyTorch's attention backend (cuDNN on Hopper), which rounds otherwise than the eager call's
  plan-free one; in deterministic mode, where an item's features must not depend on how it was encoded, the
  runner captures with the eager call's backend (`plan_free`), so a replay gives the eager call's bits
  (tests/gpu/test_deterministic_gpu.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..model.attention import plan_free_sdpa
from ..model.vision import Grid, GridMetadata, VisionEncoder, VisionOutput
from .cuda_graphs import capture_buckets

log = logging.getLogger(__name__)

Encode = Callable[[torch.Tensor, Sequence[Sequence[int]]], VisionOutput]
Capture = Callable[[torch.Tensor, Sequence[Grid]], "CapturedEncoder"]
_MAX_COUNTED = 256  # grid lists whose encodings are counted toward a capture


@dataclass
class CapturedEncoder:
    """A captured encoder call: `pixels` is its input buffer, `output` its output buffers, `meta` the grid
    metadata it reads (device tensors made before the capture, kept alive with the graph)."""

    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor
    output: VisionOutput
    meta: GridMetadata | None = None

    def run(self, pixels: torch.Tensor) -> VisionOutput:
        self.pixels.copy_(pixels)
        self.graph.replay()
        out = self.output
        return VisionOutput(out.embeds.clone(), out.deepstack.clone(), out.tokens_per_item)


def capture_encoder(visual: VisionEncoder, pixels: torch.Tensor, grids: Sequence[Grid], *,
                    pool: tuple | None = None, stream: torch.cuda.Stream | None = None,
                    plan_free: bool = False) -> CapturedEncoder:
    """`visual` over patches of `grids` captured in a CUDA graph (in memory pool `pool`, else a private one; on capture
    stream `stream`), the way the decoder's graphs are (`cuda_graphs.capture_buckets`). The grid metadata (host work
    and copies, which a capture cannot hold) is made first. `plan_free`: attention by the eager call's backends
    (`attention.plan_free_sdpa`), for the eager call's bits."""
    meta = visual.grid_metadata([list(g) for g in grids])
    static = pixels.clone()

    def encode(_):
        with plan_free_sdpa() if plan_free else contextlib.nullcontext():
            return visual.encode(static, meta)

    with torch.cuda.device(static.device):
        graphs, outputs = capture_buckets(static.device, [0], encode, pool=pool, stream=stream)
    return CapturedEncoder(graphs[0], static, outputs[0], meta)


class VisionGraphs:
    """Encodes through captured graphs where a grid list is held, else eagerly (see the module docstring)."""

    def __init__(self, encode: Encode, capture: Capture, *, max_graphs: int, capture_after: int = 2) -> None:
        if max_graphs < 1 or capture_after < 1:
            raise ValueError(f"max_graphs and capture_after must be >= 1, got {max_graphs}, {capture_after}")
        self.encode_eagerly = encode
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self._capture = capture
        self._graphs: OrderedDict[tuple[Grid, ...], CapturedEncoder] = OrderedDict()
        self._counts: OrderedDict[tuple[Grid, ...], int] = OrderedDict()
        self._uncapturable: set[tuple[Grid, ...]] = set()
        self.captures = 0
        self.replays = 0

    def __contains__(self, grids: Sequence[Sequence[int]]) -> bool:
        return _key(grids) in self._graphs

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grids: Sequence[Sequence[int]], may_capture: bool = True,
               capture_overdue: bool = True) -> VisionOutput:
        """The features of `pixels` (patches of `grids`): replayed, captured now, or eager. Captured at the list's
        `capture_after`-th encoding or later where `may_capture` (the runner's: the step does not also decode),
        and at its `2 * capture_after`-th whatever the step (see the module docstring) unless not
        `capture_overdue` (the runner's encodings on its side stream, which never capture)."""
        key = _key(grids)
        captured = self._graphs.get(key)
        count = self._count(key)
        due = captured is None and count >= self.capture_after and key not in self._uncapturable
        if due and (may_capture or (capture_overdue and count >= 2 * self.capture_after)):
            captured = self._capture_held(key, pixels)
        if captured is None:
            return self.encode_eagerly(pixels, [list(g) for g in key])
        self._graphs.move_to_end(key)
        self.replays += 1
        return captured.run(pixels)

    def release(self) -> None:
        """Destroy every captured encoder call; later encodings are eager until a list is captured again."""
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()
        self._counts.clear()

    def _count(self, key: tuple[Grid, ...]) -> int:
        count = self._counts.pop(key, 0) + 1
        self._counts[key] = count
        if len(self._counts) > _MAX_COUNTED:
            self._counts.popitem(last=False)
        return count

    def _capture_held(self, key: tuple[Grid, ...], pixels: torch.Tensor) -> CapturedEncoder | None:
        try:
            captured = self._capture(pixels, key)
        except torch.cuda.OutOfMemoryError:  # memory may free up: count the list's encodings again
            log.warning("out of memory capturing the vision encoder for grids %s; eager for now", list(key))
            self._counts[key] = 0
            return None
        except Exception:  # a capture failing (an op that cannot be captured) costs the speed, not the request
            log.exception("could not capture the vision encoder for grids %s; they stay eager", list(key))
            self._uncapturable.add(key)
            return None
        self.captures += 1
        self._graphs[key] = captured
        while len(self._graphs) > self.max_graphs:
            dropped, _ = self._graphs.popitem(last=False)
            self._counts.pop(dropped, None)  # seen twice again before it is captured again: no capture per encoding
        return captured


def _key(grids: Sequence[Sequence[int]]) -> tuple[Grid, ...]:
    return tuple((int(g[0]), int(g[1]), int(g[2])) for g in grids)
