"""The decoder's captured-graph forwards replaced by zero logits, for the host-time tools (`host_*.py`): a step then
costs only its scheduling, payload, graph-input and commit work."""

from __future__ import annotations

import torch

from prism.engine import cuda_graphs, packed_graphs


def stub_graph_forwards(vocab: int) -> None:
    """The row graphs' and the packed graphs' forwards return zero logits of their buffers' shapes (process-wide)."""
    cuda_graphs.RowGraphs._forward = lambda self, key, context_lens_host=None: torch.zeros(key[0], vocab)
    packed_graphs.PackedGraphs._forward = lambda self, bucket, real=None: torch.zeros(self.max_seqs + 1, vocab)
