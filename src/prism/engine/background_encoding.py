"""Encoding ahead beside the decodes: the vision encoder on a CUDA stream of its own.

Owns *features encoded ahead are read only after they are written*. The media of a waiting request encoded
ahead of its admission (`Scheduler`, `encode_media_ahead`) are not read by the step that encodes them, so the
step's decodes need not wait for the encoder to finish: it runs on a side stream while the decodes go on on the
main one. (`EngineConfig.encode_ahead_beside_decodes`: on with interleaving unless set; the workspace fix below
passed its GPU test in session 14.) W4 on the H200: the step that encoded 8 images ahead and then decoded took
21.5-22.5 ms, the running streams' longest gap; beside each other, the decode still waits for SMs behind the
encoder's kernels (16.5 ms), so the gap became 16-17 ms, and the cold request's TTFT grew 2-12 ms (session 13).

In a step scheduled ahead (async scheduling), the engine launches the encoding before the step's decode rows,
which then wait on the host as below (`async_steps.encode_ahead_first`, session 20); in a step scheduled after the
tokens were read, the runner queues it after the step's forwards (session 15: the decodes' kernels then reach
the SMs first; W4's longest gap 21.8 -> 17.7-18.2 ms). Its stream waits only for the main stream's last vision
work, not for the step running there (session 20: waiting for everything queued before the step's forwards
held the encoding back until the step before had finished, ~3 ms of the cold request's TTFT in W4).

Ordering, all on the device (the host waits only in `finished_before`, below):
- the side stream starts after the main stream's last vision work (`after_main_vision`: an encoding or a capture
  there, which may use the vision graphs' shared memory pool and static inputs);
- whatever touches the vision encoder or reads media features on the main stream waits for the side stream's
  event first (`order_main_after`);
- the features are marked as used by the main stream (`record_stream`), so when the encoder cache drops them
  their memory is not handed to the side stream while the main one may still read it. (Every other tensor an
  encoding allocates comes from the side stream's own blocks of the caching allocator.)
`pending` asks whether the last encoding has finished (a query, not a wait): the scheduler admits the request
whose media were sent ahead once it has, so that request's first prefill step does not wait for the encoder
inside a step, with the decodes. `finished_before` lets the engine take that decision as late as it can: when
the step in flight ends rather than when the next one is scheduled (the host runs a step ahead of the device),
or a pause after it (`EngineConfig.encode_ahead_decode_pause_ms`), in which the main stream is idle and the
encoder has the device to itself: two kernels of two streams share the SMs, so beside a decode step the
encoder advances at about half its speed (W4 on the H200: 8 images took ~26 ms beside three decode steps, ~14
alone).
One rank only: under TP the encoder's collective beside the decode graphs' all-reduces could be ordered
differently on the ranks.

Work on two streams at once must not share a cuBLAS workspace, which cuBLAS keeps per stream and a CUDA graph
bakes in from its capture stream (found by review, session 13): the side stream is none of the capture streams
(`stream_apart`), the vision graphs replayed on it were captured on a stream other than the decoder graphs'
(the runner's), and nothing is captured while encoding on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

Features = dict[bytes, tuple[torch.Tensor, torch.Tensor]]


def stream_apart(device: torch.device, taken: list[torch.cuda.Stream]) -> torch.cuda.Stream:
    """A new stream that is none of `taken` (torch hands out the streams of a fixed pool in turn)."""
    for _ in range(64):
        stream = torch.cuda.Stream(device)
        if all(stream != other for other in taken):
            return stream
    raise RuntimeError("no CUDA stream apart from the capture streams")


class BackgroundEncoding:
    def __init__(self, device: torch.device, apart_from: list[torch.cuda.Stream]) -> None:
        self.stream = stream_apart(device, apart_from)
        self._launched: torch.cuda.Event | None = None  # the last encoding's end, for `pending`
        self._unordered: torch.cuda.Event | None = None  # ... until the main stream has been ordered after it
        self._main_vision: torch.cuda.Event | None = None  # where the main stream's last vision work ends
        self.after_main_vision()  # whatever the runner queued before this existed (its warm-up)
        self.launches = 0

    def after_main_vision(self) -> None:
        """The main stream has just queued vision work (an encoding, a capture): the next encoding here waits
        for it."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        self._main_vision = event

    def run(self, encode: Callable[[], Features]) -> Features:
        """`encode()` queued on the side stream after the main stream's last vision work; its features."""
        main = torch.cuda.current_stream(self.stream.device)
        if self._main_vision is not None:
            self.stream.wait_event(self._main_vision)
        done = torch.cuda.Event()
        try:
            with torch.cuda.stream(self.stream):
                features = encode()
                for embeds, deepstack in features.values():
                    embeds.record_stream(main)
                    deepstack.record_stream(main)
        finally:  # even a failed encoding may have queued work that uses the vision pool: order after it
            done.record(self.stream)
            self._launched = self._unordered = done
        self.launches += 1
        return features

    def pending(self) -> bool:
        """Whether the last encoding launched here may still be running (never waits)."""
        return self._launched is not None and not self._launched.query()

    def finished_before(self, other: torch.cuda.Event | None, pause_s: float = 0.0, poll_s: float = 5e-5) -> bool:
        """Wait on the host until the last encoding launched here has completed, or `other` (an event on the main
        stream) has and `pause_s` more have passed, whichever comes first; whether the encoding has. Polls,
        sleeping between queries (the GIL is free for the threads preparing requests)."""
        done = self._launched
        if done is None or done.query():
            return True
        if other is None:
            return False
        while not other.query():
            if done.query():
                return True
            time.sleep(poll_s)
        until = time.perf_counter() + pause_s
        while time.perf_counter() < until:
            if done.query():
                return True
            time.sleep(poll_s)
        return done.query()

    def order_main_after(self) -> None:
        """The main stream's next work waits (on the device) for the encodings launched here."""
        if self._unordered is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self._unordered)
            self._unordered = None

    def wait(self) -> None:
        """The host waits for everything queued on the side stream (before graphs or buffers it uses go)."""
        self.stream.synchronize()
        self._unordered = None
