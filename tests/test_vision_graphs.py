"""The vision encoder's graph cache (`engine/vision_graphs.py`): which grid lists get captured, which are
dropped, and that replayed features are the caller's to keep. Off CUDA the capture is a stand-in that runs
the encoder into fixed buffers on each replay, as a graph does."""

from __future__ import annotations

import logging

import pytest
import torch

from prism.engine.vision_graphs import CapturedEncoder, VisionGraphs
from prism.model.vision import VisionOutput

A = [(1, 4, 4)]
B = [(1, 4, 4), (1, 2, 4)]


def encoder(calls: list):
    def encode(pixels: torch.Tensor, grids) -> VisionOutput:
        calls.append([tuple(g) for g in grids])
        embeds = pixels.sum(dim=1, keepdim=True).repeat(1, 3)
        return VisionOutput(embeds, torch.stack([embeds * 2]), tuple(t * h * w for t, h, w in grids))
    return encode


class _BufferGraph:
    """Replays `encode` from the input buffer into the output buffers, like a captured graph."""

    def __init__(self, encode, pixels, grids, output):
        self.encode, self.pixels, self.grids, self.output = encode, pixels, grids, output

    def replay(self):
        out = self.encode(self.pixels, self.grids)
        self.output.embeds.copy_(out.embeds)
        self.output.deepstack.copy_(out.deepstack)


def buffer_capture(captured: list, encode):
    def capture(pixels, grids):
        static = pixels.clone()
        output = encode(static, [list(g) for g in grids])
        captured.append(tuple(grids))
        return CapturedEncoder(_BufferGraph(encode, static, [list(g) for g in grids], output), static, output)
    return capture


def pixels_for(grids, seed: int) -> torch.Tensor:
    return torch.randn(sum(t * h * w for t, h, w in grids), 5, generator=torch.Generator().manual_seed(seed))


def test_a_grid_list_is_captured_the_second_time_and_then_replayed():
    calls, captured = [], []
    graphs = VisionGraphs(encoder(calls), buffer_capture(captured, encoder([])), max_graphs=2)
    eager = encoder([])
    for seed in range(4):
        x = pixels_for(A, seed)
        out = graphs.encode(x, A)
        torch.testing.assert_close(out.embeds, eager(x, A).embeds)
        torch.testing.assert_close(out.deepstack, eager(x, A).deepstack)
    assert captured == [tuple(A)] and graphs.captures == 1 and graphs.replays == 3 and A in graphs
    graphs.encode(pixels_for(B, 0), B)
    assert B not in graphs, "a grid list seen once is not captured"


def test_no_capture_beside_decodes_until_a_step_without_them_or_a_hot_list():
    """A capture costs ~50-60 ms of its step on the H200: a list due for one (capture_after = 2) stays eager while
    the runner says the step also decodes (`may_capture=False`), and is captured by the first encoding allowed to;
    a list encoded 2 * capture_after times beside decodes is captured anyway."""
    calls, captured = [], []
    graphs = VisionGraphs(encoder(calls), buffer_capture(captured, encoder([])), max_graphs=2)
    eager = encoder([])
    for seed in range(3):
        x = pixels_for(A, seed)
        torch.testing.assert_close(graphs.encode(x, A, may_capture=False).embeds, eager(x, A).embeds)
    assert captured == [] and graphs.replays == 0 and len(calls) == 3
    graphs.encode(pixels_for(A, 9), A)
    assert captured == [tuple(A)] and A in graphs
    graphs.encode(pixels_for(A, 10), A, may_capture=False)  # held already: replayed beside decodes too
    assert graphs.replays == 2 and graphs.captures == 1  # the capturing encoding replayed its graph, then this one
    for seed in range(4):
        graphs.encode(pixels_for(B, seed), B, may_capture=False)
    assert captured == [tuple(A), tuple(B)], "the fourth encoding of a list beside decodes captures it"


def test_no_capture_at_all_on_the_side_stream():
    """The runner's encodings beside the decodes (`capture_overdue=False`) never capture, however hot the list:
    a capture's warm-up runs on a stream from torch's pool, which may be the decoder graphs' capture stream and so
    share their cuBLAS workspace while they replay. A list already held is replayed there."""
    calls, captured = [], []
    graphs = VisionGraphs(encoder(calls), buffer_capture(captured, encoder([])), max_graphs=2)
    for seed in range(6):
        graphs.encode(pixels_for(A, seed), A, may_capture=False, capture_overdue=False)
    assert captured == [] and len(calls) == 6
    graphs.encode(pixels_for(A, 9), A)
    graphs.encode(pixels_for(A, 10), A, may_capture=False, capture_overdue=False)
    assert captured == [tuple(A)] and graphs.replays == 2


def test_the_least_recently_used_grid_list_is_dropped():
    captured = []
    graphs = VisionGraphs(encoder([]), buffer_capture(captured, encoder([])), max_graphs=1)
    for grids in (A, A, B, B, A):
        graphs.encode(pixels_for(grids, 1), grids)
    assert captured == [tuple(A), tuple(B)] and A not in graphs  # B pushed A out; A counts its encodings again
    graphs.encode(pixels_for(A, 1), A)
    assert captured == [tuple(A), tuple(B), tuple(A)]  # A, seen twice since, came back
    assert A in graphs and B not in graphs


def test_replayed_features_are_the_callers_to_keep():
    graphs = VisionGraphs(encoder([]), buffer_capture([], encoder([])), max_graphs=1, capture_after=1)
    first = graphs.encode(pixels_for(A, 1), A)
    kept = first.embeds.clone()
    graphs.encode(pixels_for(A, 2), A)  # the next replay rewrites the graph's buffers ...
    torch.testing.assert_close(first.embeds, kept)  # ... not what the first caller holds


def test_a_capture_that_fails_is_logged_and_its_grids_stay_eager(caplog):
    calls, attempts = [], []

    def failing_capture(pixels, grids):
        attempts.append(grids)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = VisionGraphs(encoder(calls), failing_capture, max_graphs=2, capture_after=1)
    with caplog.at_level(logging.ERROR, logger="prism.engine.vision_graphs"):
        for seed in range(3):
            x = pixels_for(A, seed)
            torch.testing.assert_close(graphs.encode(x, A).embeds, encoder([])(x, A).embeds)
    assert len(attempts) == 1 and len(calls) == 3 and graphs.captures == 0
    assert "could not capture the vision encoder" in caplog.text


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_graphs"):
        VisionGraphs(encoder([]), buffer_capture([], encoder([])), max_graphs=0)


def test_a_capture_out_of_memory_is_tried_again_later(caplog):
    attempts = []

    def capture(pixels, grids):
        attempts.append(grids)
        if len(attempts) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return buffer_capture([], encoder([]))(pixels, grids)

    graphs = VisionGraphs(encoder([]), capture, max_graphs=1)
    with caplog.at_level(logging.WARNING, logger="prism.engine.vision_graphs"):
        for seed in range(4):
            graphs.encode(pixels_for(A, seed), A)
    assert len(attempts) == 2 and graphs.captures == 1 and A in graphs  # 2nd encoding failed, 4th captured
    assert "out of memory" in caplog.text


def _meta_encoder():
    from prism.model.config import Qwen3VLConfig
    from prism.model.vision import VisionEncoder
    from prism.testing.checkpoints import checkpoint_config

    config = Qwen3VLConfig.from_dict(checkpoint_config("tiny")).vision
    with torch.device("meta"):
        visual = VisionEncoder(config).to(torch.bfloat16)
    pixels = torch.zeros(sum(t * h * w for t, h, w in B), config.patch_dim, device="meta", dtype=torch.bfloat16)
    return visual, pixels


def test_the_captured_encoder_call_reads_no_host_tensor(monkeypatch):
    """What `capture_encoder` captures (`VisionEncoder.encode` over metadata made before) reads no host tensor; the
    first version, which captured the grid metadata's host-to-device copies too, is caught (the reproducer
    `vision_capture_reads_host_tensors.py` runs the same check)."""
    from prism.model.vision import VisionEncoder
    from prism.testing.host_reads import host_tensor_reads

    visual, pixels = _meta_encoder()
    meta = visual.grid_metadata(B)
    assert host_tensor_reads(lambda: visual.encode(pixels, meta)) == []

    encode = VisionEncoder.encode
    monkeypatch.setattr(VisionEncoder, "encode",  # the first version: the metadata made inside the captured call
                        lambda self, x, m: encode(self, x, self.grid_metadata(m.grids)))
    assert host_tensor_reads(lambda: visual.encode(pixels, meta)), "host reads inside the captured call went unseen"
