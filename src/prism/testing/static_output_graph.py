"""A CPU stand-in for a captured packed-graph bucket (`engine.packed_graphs.PackedGraphs`), for tests and reproducers
of what a replay's *output buffer* does: nothing is captured off CUDA, so without it a CPU run never sees a replay
write over its previous logits.

`stand_in_static_output_graph(holder, bucket, rows)` installs it: every replay writes the bucket's eager forward over
the holder's filled buffers into one static output tensor of `rows` rows, as a CUDA graph replay writes its captured
output, and `holder.run` then reads that buffer as it reads a real replay's.
"""

from __future__ import annotations

import torch


class StaticOutputGraph:
    """What `PackedGraphs` asks of a captured graph (`replay`, `reset`), writing into the holder's static output."""

    def __init__(self, holder, bucket: int) -> None:
        self.holder, self.bucket, self.lengths = holder, bucket, None
        fill = holder._fill

        def recording_fill(step, media, bucket=None):  # the real host lengths, which the forward needs
            out = fill(step, media, bucket)
            self.lengths = out[1]
            return out

        holder._fill = recording_fill

    def replay(self) -> None:
        self.holder._outputs[self.bucket].copy_(self.holder._forward(self.bucket, self.lengths))

    def reset(self) -> None:
        pass


def stand_in_static_output_graph(holder, bucket: int, rows: int) -> StaticOutputGraph:
    """`holder`'s `bucket` replayed by a `StaticOutputGraph` into a zeroed output of `rows` logits rows."""
    graph = holder._graphs[bucket] = StaticOutputGraph(holder, bucket)
    text = holder.model.config.text
    holder._outputs[bucket] = torch.zeros(rows, text.vocab_size, dtype=holder.model.dtype)
    return graph
