"""Async scheduling: a step's sampled tokens reach the host while the next decode step already runs.

Owns *the host never acts on a token it has not read*. A step whose tokens were sampled on the device becomes
an `InflightStep`: its token ids (and logprobs) are copied to pinned host memory behind an event, nothing
synchronizes the stream. While it is in flight the engine may launch the next decode step of the same
sequences, fed those tokens on the device (`ModelRunner.execute_decode_rows`); the KV manager holds each of
them as a `PENDING_TOKEN` that is never published. `host_tokens` waits for the event, never for the stream,
so the launched step keeps running while the host commits this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import SampleResult, take_rows
from .scheduler import ScheduledSlice


def _copy_to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """An asynchronous device-to-host copy into pinned memory (the tensor itself when already on the host)."""
    if t is None or t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class InflightStep:
    """A launched step's sampling rows: `sampled[i]` drew `result.token_ids[i]` (device) / `host.token_ids[i]`."""

    sampled: list[ScheduledSlice]
    result: SampleResult  # on the device: what a continuation feeds on
    host: SampleResult  # pinned host copies, valid once `ready` has fired
    ready: torch.cuda.Event | None

    @classmethod
    def launch(cls, sampled: list[ScheduledSlice], result: SampleResult) -> InflightStep:
        host = SampleResult(*(_copy_to_host(t) for t in (result.token_ids, result.logprobs,
                                                         result.top_token_ids, result.top_logprobs)))
        ready = None
        device = result.token_ids.device
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # the copies' stream, whatever the current device
        return cls(sampled, result, host, ready)

    def host_result(self) -> SampleResult:
        """The sampled tokens (and logprobs) on the host: waits for this step only, not for later launches."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host

    def device_tokens_of(self, rows: list[int]) -> torch.Tensor:
        """The device token ids of sampling rows `rows`, in that order (a continuation's inputs)."""
        return take_rows(self.result.token_ids, rows)
