"""`engine/step_building.py`: a forward's rows as rank 0 builds them: M-RoPE positions across the prompt / output
boundary, and deterministic mode's page-aligned tiles of exactly one page of rows."""

from __future__ import annotations

import torch

from prism.engine.prompt import PreparedPrompt
from prism.engine.request import Request
from prism.engine.sampling import SamplingParams
from prism.engine.scheduler import ScheduledSlice
from prism.engine.step_building import deterministic_tiles, token_positions


def _request(prompt_len: int, outputs: int, rope_delta: int = -5) -> Request:
    positions = torch.stack([torch.arange(prompt_len), torch.arange(prompt_len) * 2, torch.arange(prompt_len) * 3])
    prompt = PreparedPrompt(list(range(100, 100 + prompt_len)), torch.zeros(prompt_len, dtype=torch.int64),
                            positions, rope_delta, ())
    request = Request("r", prompt, SamplingParams(max_tokens=8), 0)
    request.output_token_ids = list(range(outputs))
    return request


def test_token_positions_take_the_prompts_then_continue_with_the_rope_delta():
    request = _request(prompt_len=6, outputs=3)
    got = token_positions(request, 4, 8)  # two prompt tokens, then two generated ones
    assert got.tolist() == [[4, 5, 1, 2], [8, 10, 1, 2], [12, 15, 1, 2]]  # 6 - 5, 7 - 5 on every axis
    assert token_positions(request, 7, 8).tolist() == [[2], [2], [2]]  # a decode row: 7 + delta on every axis
    assert token_positions(request, 0, 6).tolist() == request.prompt.positions.tolist()


def test_deterministic_tiles_are_whole_pages_of_one_sequence_from_the_page_start():
    page = 4
    request = _request(prompt_len=10, outputs=0)
    # a prefix hit of 5 tokens: the step computes [5, 10); its tiles start at the hit's page start, 4
    tiles = deterministic_tiles([ScheduledSlice(request, 5, 10)], page)
    spans = [(start, end, pad, sample) for ((s, start, end, pad, sample),) in tiles]
    assert spans == [(4, 8, 0, False), (8, 10, 2, True)]
    for (_, start, end, pad, _), in tiles:
        assert start % page == 0 and end - start + pad == page  # exactly one page of rows, page-aligned
    other = _request(prompt_len=3, outputs=0)
    both = deterministic_tiles([ScheduledSlice(request, 9, 10), ScheduledSlice(other, 0, 3)], page)
    assert [len(t) for t in both] == [1, 1]  # every tile holds one sequence, whatever its companions
    assert [(t[0][1], t[0][2], t[0][3]) for t in both] == [(8, 10, 2), (0, 3, 1)]
