"""Engine pieces without a model: config loading, the request state machine, chunk snapping; and the
engine's request-level errors and abort semantics on the tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import prism
from prism.engine.config import ConfigError, EngineConfig
from prism.engine.engine import RequestError
from prism.engine.request import FinishReason, Request, RequestState, RequestStateError
from prism.engine.sampling import SamplingParams
from prism.engine.scheduler import shared_pages, snap_chunk_end
from prism.kv.content import MediaSpan, SeqContent
from prism.kv.keys import chain_keys, root_key
from prism.testing.checkpoints import ensure_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    assert isinstance(EngineConfig.from_json(path), EngineConfig)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"page_sise": 16}, "unknown engine config keys: \\['page_sise'\\]"),
        ({"page_size": 0}, "page_size must be a positive integer"),
        ({"kv_dtype": "int4"}, "kv_dtype must be one of"),
        ({"preemption": "swap"}, "needs num_cpu_pages"),
        ({"max_num_seqs": True}, "max_num_seqs must be a positive integer"),
        ({"dtype": "float64"}, "dtype must be"),
        ({"encode_media_ahead": "false"}, "encode_media_ahead must be true or false"),
        ({"cuda_graphs": 0}, "cuda_graphs must be true or false"),
        ({"cuda_graph_max_packed_tokens": 8}, "0 \\(off\\) or an integer >= 32"),
        ({"vision_cuda_graphs": -1}, "vision_cuda_graphs must be 0 \\(off\\)"),
        ({"vision_cuda_graphs": True}, "vision_cuda_graphs must be 0 \\(off\\)"),
        ({"min_tail_copy_tokens": -1}, "min_tail_copy_tokens must be a non-negative integer or null"),
        ({"min_tail_copy_tokens": "8"}, "min_tail_copy_tokens must be a non-negative integer or null"),
        ({"python_switch_interval_ms": 0}, "python_switch_interval_ms must be a finite number >= 0.001 or null"),
        ({"python_switch_interval_ms": True}, "python_switch_interval_ms must be a finite number >= 0.001 or null"),
        ({"python_switch_interval_ms": float("inf")}, "python_switch_interval_ms must be a finite number"),
        ({"encode_ahead_beside_decodes": "yes"}, "encode_ahead_beside_decodes must be true, false or null"),
        ({"encode_ahead_decode_pause_ms": -1}, "encode_ahead_decode_pause_ms must be a number of ms in \\[0, 1000\\]"),
        ({"encode_ahead_decode_pause_ms": "5"}, "encode_ahead_decode_pause_ms must be a number of ms"),
        ({"encode_ahead_decode_pause_ms": float("nan")}, "encode_ahead_decode_pause_ms must be a number of ms"),
        ({"max_image_pixels": 0}, "max_image_pixels must be a positive integer"),
        ({"max_image_pixels": 2.0**28}, "max_image_pixels must be a positive integer"),
        ({"max_video_pixels": 0}, "max_video_pixels must be a positive integer"),
        ({"max_video_pixels": True}, "max_video_pixels must be a positive integer"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_with_a_reason(raw, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(raw)


def test_media_are_encoded_beside_the_decodes_with_interleaving_unless_set():
    assert not EngineConfig().encodes_ahead_beside_decodes
    assert EngineConfig(interleave_prefill_tokens=512).encodes_ahead_beside_decodes
    assert not EngineConfig(interleave_prefill_tokens=512, encode_ahead_beside_decodes=False).encodes_ahead_beside_decodes
    assert EngineConfig(encode_ahead_beside_decodes=True).encodes_ahead_beside_decodes


def test_the_tail_copy_threshold_is_an_eighth_of_a_page_unless_given():
    assert EngineConfig(page_size=256).tail_copy_threshold == 32
    assert EngineConfig(page_size=16).tail_copy_threshold == 2
    assert EngineConfig(page_size=256, min_tail_copy_tokens=0).tail_copy_threshold == 0


def test_the_engine_sets_the_gil_switch_interval_unless_told_not_to():
    import sys

    from prism.engine.engine import Engine
    from prism.testing.checkpoints import ensure_tiny_checkpoint

    sys.setswitchinterval(0.005)  # conftest's autouse fixture restores the interval after the test
    Engine(ensure_tiny_checkpoint(), EngineConfig(python_switch_interval_ms=None, num_gpu_pages=32))
    assert sys.getswitchinterval() == 0.005
    Engine(ensure_tiny_checkpoint(), EngineConfig(num_gpu_pages=32))
    assert abs(sys.getswitchinterval() - 0.0005) < 1e-9


def test_config_from_bad_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        EngineConfig.from_json(path)
    path.write_text(json.dumps({"page_size": 8}))
    assert EngineConfig.from_json(path).page_size == 8


def test_max_model_len_cannot_exceed_the_pool():
    config = EngineConfig(max_model_len=1000)
    with pytest.raises(ConfigError, match="could never finish"):
        config.resolved_max_model_len(pool_tokens=999)
    assert EngineConfig().resolved_max_model_len(pool_tokens=500) == 500


def test_request_state_machine_allows_only_its_table():
    request = Request("r", prompt=None, params=SamplingParams(), arrival_order=0)
    with pytest.raises(RequestStateError):
        request.transition(RequestState.SWAPPED)  # waiting requests hold no pages to swap
    request.transition(RequestState.RUNNING)
    request.transition(RequestState.SWAPPED)
    request.transition(RequestState.RUNNING)
    request.finish(FinishReason.STOP)
    with pytest.raises(RequestStateError):
        request.finish(FinishReason.ABORT)  # exactly one terminal state


def test_chunk_end_never_cuts_a_visual_span():
    content = SeqContent([1] * 20, (MediaSpan(4, 10, b"\x01" * 16),))
    assert snap_chunk_end(content, 0, 8) == 4
    assert snap_chunk_end(content, 0, 14) == 14
    assert snap_chunk_end(content, 4, 20) == 20
    assert snap_chunk_end(content, 0, 3) == 3


@pytest.fixture(scope="module")
def engine():
    return prism.Engine(ensure_tiny_checkpoint(), EngineConfig(page_size=4, num_gpu_pages=64, max_num_batched_tokens=80))


def test_add_request_errors(engine):
    engine.add_request("dup", "hello", SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", "hello")
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("long", "word " * 400)
    from prism.testing.hf_reference import random_images

    (big,) = random_images([(320, 320)])  # 100 visual tokens at the checkpoint's settings, 80 a step here
    photo = [{"role": "user", "content": [{"type": "image", "image": big}]}]
    request = engine.add_request("wide", photo)  # downscaled to what one step computes (session 27's review)
    ((_, tokens),) = request.prompt.media[0].spans
    assert 64 <= tokens <= 80, f"the 320x320 image became {tokens} tokens"
    from prism.engine.inputs import InputProcessor

    uncapped = InputProcessor(engine.model_dir).prepare_chat(photo)  # a prompt prepared elsewhere: still refused
    with pytest.raises(RequestError, match="of 100 visual tokens is too large for this server.*megapixels"):
        engine.add_request("wide-prepared", uncapped)
    import dataclasses

    prepared = engine.inputs.prepare_prompt("a hand-built prompt")
    vocab = engine.runner.model.config.text.vocab_size
    for bad in ([-3], [vocab]):  # an id anywhere in the prompt, not only in the detokenizer's context window
        with pytest.raises(RequestError, match="token ids must be integers"):
            engine.add_request("bad-ids", dataclasses.replace(prepared, token_ids=bad + prepared.token_ids[1:] * 4))
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_gives_exactly_one_terminal_event_and_frees_pages(engine):
    engine.add_request("a", "tell me something long", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "and something else", SamplingParams(max_tokens=3, ignore_eos=True))
    events = engine.step() + engine.step()
    engine.abort("a")
    engine.abort("a")  # a second abort is a no-op
    engine.abort("never-existed")
    while engine.has_unfinished_requests():
        events += engine.step()
    terminal = [e for e in events if e.finished]
    assert sorted(e.request_id for e in terminal) == ["a", "b"]
    assert next(e for e in terminal if e.request_id == "a").finish_reason is FinishReason.ABORT
    assert not engine.kv.seqs
    engine.kv.clear_cache()
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_pages


def test_lazy_top_level_exports():
    assert prism.LLM.__name__ == "LLM" and prism.SamplingParams.__name__ == "SamplingParams"
    with pytest.raises(AttributeError):
        prism.NotAThing  # noqa: B018


@given(st.lists(st.integers(1, 3), max_size=40), st.lists(st.integers(1, 3), max_size=40), st.integers(1, 4))
def test_shared_pages_is_the_common_prefix_of_two_key_chains(a: list[int], b: list[int], page_size: int) -> None:
    """The binary search over chained page keys equals a scan of the whole pages whose tokens agree."""
    root = root_key("units")
    keys_a, keys_b = chain_keys(SeqContent(a), root, page_size), chain_keys(SeqContent(b), root, page_size)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert shared_pages(keys_a, keys_b) == min(common // page_size, len(keys_a), len(keys_b))


def test_a_max_model_len_below_two_is_refused():
    """Review (session 28): `max_model_len: 1` started a server that refused every request."""
    with pytest.raises(ConfigError, match="at least 2"):
        EngineConfig(max_model_len=1)
    assert EngineConfig(max_model_len=2).max_model_len == 2
