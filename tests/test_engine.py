"""Engine tests on the tiny checkpoint (CPU, fp32 weights): HF parity of greedy generation, prefix reuse
that changes nothing (hit == miss), media identity, FP8 vs BF16 KV agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prism.engine.llm import LLM
from prism.engine.request import FinishReason
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

GREEDY = SamplingParams.greedy(max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine has 2 cores shared with the test runner
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt():
    return ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()


def chat(*parts) -> list[dict]:
    content = [{"type": "image", "image": p} if not isinstance(p, str) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


IMAGES = random_images([(64, 96), (96, 64), (64, 64)], seed=3)
FRAMES = np.random.default_rng(5).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)


def hf_greedy(hf_model, prompt, max_new_tokens: int, **generate_kwargs) -> list[int]:
    kwargs = {
        "input_ids": torch.tensor([prompt.token_ids]),
        "attention_mask": torch.ones(1, len(prompt.token_ids), dtype=torch.long),
        "mm_token_type_ids": torch.as_tensor(prompt.mm_token_type_ids)[None],
    }
    if prompt.images:
        kwargs["pixel_values"] = torch.cat([m.pixel_values for m in prompt.images])
        kwargs["image_grid_thw"] = prompt.image_grid_thw
    if prompt.videos:
        kwargs["pixel_values_videos"] = torch.cat([m.pixel_values for m in prompt.videos])
        kwargs["video_grid_thw"] = prompt.video_grid_thw
    with torch.no_grad():
        out = hf_model.generate(**kwargs, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs)
    return out[0, len(prompt.token_ids) :].tolist()


@pytest.mark.parametrize(
    "case",
    [
        "text",
        "images",
        "video",
    ],
)
def test_greedy_matches_hf_generate(ckpt, hf_model, case):
    llm = LLM(ckpt, kv_dtype="fp32", page_size=4, num_gpu_pages=128, max_num_batched_tokens=96, check_invariants=True)
    if case == "text":
        messages = chat("Tell me a story about paged attention.")
    elif case == "images":
        messages = chat(IMAGES[0], IMAGES[1], "Compare these two images.")
    else:
        messages = [{"role": "user", "content": [{"type": "video", "video": FRAMES, "fps": 2.0},
                                                 {"type": "text", "text": "What happens?"}]}]
    prompt = llm.engine.inputs.prepare_chat(messages)
    expected = hf_greedy(hf_model, prompt, 12)
    (ours,) = llm.generate([prompt], GREEDY)
    assert ours.token_ids[: len(expected)] == expected, f"{case}: ours {ours.token_ids} vs HF {expected}"


def _run(llm: LLM, messages_list):
    return [c.token_ids for c in llm.generate(messages_list, GREEDY)]


def test_prefix_reuse_changes_no_token(ckpt):
    """Cache off, cold, warm, new question on the same images, partial hit, after eviction: same greedy tokens."""
    common = dict(page_size=4, max_num_batched_tokens=80, check_invariants=True)
    q1 = chat(IMAGES[0], IMAGES[1], "What is in both pictures?")
    q2 = chat(IMAGES[0], IMAGES[1], "Which one is brighter, and why?")
    q3 = chat(IMAGES[0], IMAGES[2], "What is in both pictures?")  # shares only the first image

    off = LLM(ckpt, enable_prefix_cache=False, num_gpu_pages=64, **common)
    expected = {name: _run(off, [m])[0] for name, m in (("q1", q1), ("q2", q2), ("q3", q3))}
    assert off.engine.kv.stats.hit_tokens == 0

    on = LLM(ckpt, num_gpu_pages=64, **common)
    stats = on.engine.runner.stats
    assert _run(on, [q1])[0] == expected["q1"]  # cold
    encoded = stats.vision_items_encoded
    assert encoded == 2
    (warm,) = on.generate([q1], GREEDY)
    assert warm.token_ids == expected["q1"] and warm.cached_tokens > 0  # warm: full hit
    (new_question,) = on.generate([q2], GREEDY)
    assert new_question.token_ids == expected["q2"] and new_question.cached_tokens > 0
    assert stats.vision_items_encoded == encoded, "a full hit over the images must skip the vision encoder"
    (partial,) = on.generate([q3], GREEDY)
    assert partial.token_ids == expected["q3"]
    assert 0 < partial.cached_tokens < len(on.engine.inputs.prepare_chat(q3).token_ids) - 20

    # A pool that holds about one request: every new prompt evicts the previous one's pages.
    tight = LLM(ckpt, num_gpu_pages=48, **common)
    assert _run(tight, [q1]) == [expected["q1"]]
    assert _run(tight, [q3]) == [expected["q3"]]
    assert _run(tight, [q2]) == [expected["q2"]]
    assert _run(tight, [q1]) == [expected["q1"]]
    assert tight.engine.kv.entries.evictions > 0, "the tight pool should have evicted cached prefixes"


def test_same_placeholders_other_pixels_and_other_left_context_miss(ckpt):
    llm = LLM(ckpt, page_size=4, num_gpu_pages=64)
    base = llm.generate([chat(IMAGES[0], "Describe it.")], GREEDY)[0]
    assert base.cached_tokens == 0
    swapped_pixels = llm.generate([chat(IMAGES[2], "Describe it.")], GREEDY)[0]
    # same token ids (both 64x64... sizes differ here, so compare the reuse directly): only text before the image
    prompt = llm.engine.inputs.prepare_chat(chat(IMAGES[2], "Describe it."))
    assert swapped_pixels.cached_tokens <= prompt.media[0].start
    # Same pixels, same placeholders, but a system message first: the left context changed, no reuse past it.
    with_system = [{"role": "system", "content": "Be brief."}, *chat(IMAGES[0], "Describe it.")]
    other_left = llm.generate([with_system], GREEDY)[0]
    prompt0 = llm.engine.inputs.prepare_chat(chat(IMAGES[0], "Describe it."))
    prompt1 = llm.engine.inputs.prepare_chat(with_system)
    shared = next(i for i, (a, b) in enumerate(zip(prompt0.token_ids, prompt1.token_ids, strict=False)) if a != b)
    assert other_left.cached_tokens <= shared


def test_same_size_images_with_other_pixels_never_share_kv(ckpt):
    """Two images with identical placeholder tokens (same size) but different pixels."""
    a, b = random_images([(64, 64), (64, 64)], seed=11)
    llm = LLM(ckpt, page_size=4, num_gpu_pages=64)
    pa = llm.engine.inputs.prepare_chat(chat(a, "Describe it."))
    pb = llm.engine.inputs.prepare_chat(chat(b, "Describe it."))
    assert pa.token_ids == pb.token_ids and pa.media[0].digest != pb.media[0].digest
    llm.generate([pa], GREEDY)
    (out_b,) = llm.generate([pb], GREEDY)
    assert out_b.cached_tokens <= pb.media[0].start
    off = LLM(ckpt, page_size=4, num_gpu_pages=64, enable_prefix_cache=False)
    assert out_b.token_ids == off.generate([pb], GREEDY)[0].token_ids


def test_fp8_kv_agrees_with_bf16_kv(ckpt, record_property):
    prompts = [chat(f"Question number {i}: what is {i} plus {i}?") for i in range(4)]
    prompts += [chat(IMAGES[i % 3], f"Image question {i}") for i in range(4)]
    fp8 = LLM(ckpt, kv_dtype="fp8", page_size=4, num_gpu_pages=256)
    bf16 = LLM(ckpt, kv_dtype="bf16", page_size=4, num_gpu_pages=256)
    a = _run(fp8, prompts)
    b = _run(bf16, prompts)
    same = sum(x == y for ta, tb in zip(a, b, strict=True) for x, y in zip(ta, tb, strict=True))
    total = sum(len(t) for t in a)
    rate = same / total
    record_property("fp8_bf16_greedy_token_agreement", rate)
    print(f"FP8 vs BF16 KV: {same}/{total} greedy tokens agree ({rate:.1%}), {sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)} sequences identical")
    assert rate >= 0.75, f"FP8 KV agrees with BF16 KV on only {rate:.1%} of greedy tokens"


def test_finish_reasons_and_stop(ckpt):
    llm = LLM(ckpt, page_size=4, num_gpu_pages=64)
    (free,) = llm.generate([chat("Count with me.")], SamplingParams.greedy(max_tokens=6, ignore_eos=True))
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 6
    stop_id = free.token_ids[2]
    (stopped,) = llm.generate(
        [chat("Count with me.")], SamplingParams.greedy(max_tokens=6, ignore_eos=True, stop_token_ids=(stop_id,))
    )
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


def test_interleaving_bounds_prefill_chunks_while_decoding_and_changes_no_token(ckpt):
    """interleave_prefill_tokens: while a request decodes, a later prompt is prefilled in chunks of at most
    the limit (a visual span longer than the limit goes whole, never cut); the tokens are those of the
    engine without interleaving."""
    common = dict(page_size=4, num_gpu_pages=160, max_num_batched_tokens=256, check_invariants=True)
    params = SamplingParams.greedy(max_tokens=12, ignore_eos=True)
    long_text = "A long text prompt that is prefilled while the first request decodes. " * 3
    prompts = ["Count to twenty please.", chat(IMAGES[0], IMAGES[1], long_text)]

    def run(llm: LLM) -> tuple[list[list[int]], list[tuple[str, int, int]]]:
        seen: list[tuple[str, int, int]] = []
        execute = llm.engine.runner.execute

        def recording(slices, kv, *rest, **kwargs):
            seen.extend((s.request.request_id, s.start, s.end) for s in slices)
            return execute(slices, kv, *rest, **kwargs)

        llm.engine.runner.execute = recording
        engine = llm.engine
        engine.add_request("decoder", prompts[0], SamplingParams.greedy(max_tokens=80, ignore_eos=True))
        for _ in range(3):
            engine.step()  # the first request is decoding now
        engine.add_request("late", engine.inputs.prepare_chat(prompts[1]), params)
        tokens: dict[str, list[int]] = {"decoder": [], "late": []}
        while engine.has_unfinished_requests():
            for event in engine.step():
                tokens[event.request_id].extend(event.new_token_ids)
        return [tokens["decoder"], tokens["late"]], seen

    plain_tokens, plain_slices = run(LLM(ckpt, **common))
    limit = 8
    inter_tokens, inter_slices = run(LLM(ckpt, interleave_prefill_tokens=limit, **common))
    assert inter_tokens == plain_tokens
    late = LLM(ckpt, **common).engine.inputs.prepare_chat(prompts[1])
    spans = {(s, s + n) for m in late.media for s, n in m.spans}
    prefill = [(a, b) for rid, a, b in inter_slices if rid == "late" and a < len(late.token_ids) - 1]
    assert len(prefill) > len([1 for rid, a, _ in plain_slices if rid == "late" and a < len(late.token_ids) - 1])
    for a, b in prefill:
        assert b - a <= limit or (a, b) in spans, f"chunk [{a}, {b}) exceeds {limit} and is not one whole span"
    assert any((a, b) in spans and b - a > limit for a, b in prefill), "the test needs a span longer than the limit"


def test_async_chunks_launch_the_scheduled_chunks_early_and_change_no_token(ckpt):
    """Async scheduling with a prompt interleaved beside decodes: each of its chunks after the first is launched
    while the previous step runs (beside the decode rows, in the packed step), and the chunks, their order and
    the tokens are those of the engine that schedules every step."""
    common = dict(page_size=4, num_gpu_pages=160, max_num_batched_tokens=256, interleave_prefill_tokens=8,
                  graph_rows_without_cuda=True, cuda_graph_max_packed_tokens=128, check_invariants=True)
    long_text = "A long text prompt that is prefilled while the first request decodes. " * 3

    def run(llm: LLM) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
        engine = llm.engine
        runner = engine.runner
        chunks: list[tuple[int, int]] = []
        execute, execute_decode_rows = runner.execute, runner.execute_decode_rows

        def recording(slices, kv, *rest, **kwargs):
            chunks.extend((s.start, s.end) for s in slices
                          if s.request.request_id == "late" and s.start < s.request.num_prompt_tokens)
            return execute(slices, kv, *rest, **kwargs)

        def recording_rows(slices, kv, plan, token_ids, chunk=None):
            if chunk is not None:
                chunks.append((chunk.start, chunk.end))
            return execute_decode_rows(slices, kv, plan, token_ids, chunk=chunk)

        runner.execute, runner.execute_decode_rows = recording, recording_rows
        for i in range(2):
            engine.add_request(f"d{i}", f"Count to twenty, number {i}.",
                               SamplingParams.greedy(max_tokens=60, ignore_eos=True))
        for _ in range(3):
            engine.step()  # both decode now
        engine.add_request("late", engine.inputs.prepare_chat(chat(IMAGES[0], long_text)),
                           SamplingParams.greedy(max_tokens=6, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for event in engine.step():
                tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
        return tokens, chunks

    want_tokens, want_chunks = run(LLM(ckpt, async_scheduling=False, **common))
    llm = LLM(ckpt, **common)
    got_tokens, got_chunks = run(llm)
    assert got_tokens == want_tokens
    assert got_chunks == want_chunks, "the continuation's chunks are not the scheduler's"
    assert len(want_chunks) >= 4, f"the test needs a prompt in several chunks: {want_chunks}"
    # The first chunk is scheduled (the request is admitted); each later one follows the step in flight.
    assert llm.engine.stats.async_chunk_steps == len(want_chunks) - 1, (llm.engine.stats, want_chunks)


@pytest.mark.parametrize("packed", [128, 0], ids=["packed", "eager"])
def test_async_admissions_schedule_waiting_requests_while_a_step_runs(ckpt, packed):
    """More requests than seats, prompts interleaved beside decodes: with `async_admissions`, a step that admits a
    waiting request (as a seat frees) is scheduled and launched while the step before it is in flight, its decode
    rows fed that step's tokens on the device (in the packed graphs, or the eager forward without them). Every
    request's tokens, and every prompt's chunks, are those of the engine that schedules each step after reading
    the last one's tokens (the scheduler knows the rows decode before their tokens are read)."""
    common = dict(page_size=16, num_gpu_pages=64, max_num_seqs=2, interleave_prefill_tokens=8,
                  graph_rows_without_cuda=True, cuda_graph_max_packed_tokens=packed, check_invariants=True)
    prompts = [chat(IMAGES[0], "Describe it."), "Count to ten.", chat(IMAGES[1], "What is it?"),
               "Name a colour, then another one, then a third one, please."]
    params = [SamplingParams.greedy(max_tokens=n, ignore_eos=True) for n in (6, 9, 5, 7)]

    def run(llm: LLM) -> tuple[list[list[int]], list[tuple[str, int, int]]]:
        runner = llm.engine.runner
        chunks: list[tuple[str, int, int]] = []
        execute, execute_decode_rows = runner.execute, runner.execute_decode_rows

        def recording(slices, kv, *rest, **kwargs):
            chunks.extend((s.request.request_id, s.start, s.end) for s in slices if s.start < s.request.num_prompt_tokens)
            return execute(slices, kv, *rest, **kwargs)

        def recording_rows(slices, kv, plan, token_ids, chunk=None):
            if chunk is not None:
                chunks.append((chunk.request.request_id, chunk.start, chunk.end))
            return execute_decode_rows(slices, kv, plan, token_ids, chunk=chunk)

        runner.execute, runner.execute_decode_rows = recording, recording_rows
        return [c.token_ids for c in llm.generate(prompts, params)], chunks

    want, want_chunks = run(LLM(ckpt, async_scheduling=False, **common))
    llm = LLM(ckpt, async_admissions=True, **common)
    got, got_chunks = run(llm)
    assert got == want
    assert sorted(got_chunks) == sorted(want_chunks), "the steps scheduled ahead chunked the prompts differently"
    assert any(end - start <= 8 and start > 0 for _, start, end in want_chunks), "the test needs interleaved chunks"
    assert llm.engine.stats.scheduled_ahead_steps >= 2, llm.engine.stats


@pytest.mark.parametrize("admissions", [False, True], ids=["scheduled-after", "admissions-ahead"])
def test_async_scheduling_returns_a_steps_tokens_before_scheduling_the_next(ckpt, admissions):
    """Async scheduling: while requests decode, each call launches the next decode step and returns the previous
    step's tokens. When a new request arrives (the next step must be scheduled: it has a prefill), the call that
    commits the step in flight returns its tokens at once, so the running streams' tokens are not held back behind
    the prefill. Without `async_admissions` the scheduled step runs in the next call; with it, it is scheduled and
    launched in this call, before the step in flight is committed, and its tokens come in the next."""
    llm = LLM(ckpt, kv_dtype="fp8", page_size=16, num_gpu_pages=64, graph_rows_without_cuda=True,
              check_invariants=True, async_admissions=admissions)
    engine = llm.engine
    executed: list[int] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda *a, **k: (executed.append(1), execute(*a, **k))[1]
    engine.add_request("a", "Count to twenty please.", SamplingParams.greedy(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    launched = engine.stats.async_steps
    assert launched > 0 and engine._inflight is not None, "decode steps must be launched ahead"
    engine.add_request("b", "Hi.", SamplingParams.greedy(max_tokens=2, ignore_eos=True))
    executed.clear()
    events = engine.step()
    assert [e.request_id for e in events] == ["a"], "the step in flight commits alone"
    if admissions:
        assert executed and engine.stats.scheduled_ahead_steps == 1 and engine._inflight is not None
        assert engine.stats.async_steps == launched + 1
    else:
        assert not executed and engine.stats.async_steps == launched and engine._inflight is None
        events = engine.step()
        assert executed, "then the step with b's prefill runs"
    events = engine.step() if admissions else events
    assert {e.request_id for e in events} == {"a", "b"}, "the step with b's prefill returns both tokens"
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.kv.seqs


def test_async_scheduling_commits_the_step_in_flight_when_the_launched_one_fails(ckpt):
    """A launched decode step that fails ends its requests with an error, after the step in flight commits: the
    token it sampled is streamed (found by review: it was dropped, and a request whose last token was a stop
    ended in ERROR instead of STOP); nothing leaks."""
    greedy = SamplingParams.greedy(max_tokens=12, ignore_eos=True)
    kw = dict(kv_dtype="fp8", page_size=16, num_gpu_pages=64, graph_rows_without_cuda=True, check_invariants=True)
    want = LLM(ckpt, async_scheduling=False, **kw).generate(["Count to twenty please."], greedy)[0].token_ids
    llm = LLM(ckpt, **kw)
    execute_decode_rows = llm.engine.runner.execute_decode_rows
    calls = []

    def third_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted failure")
        return execute_decode_rows(*args, **kwargs)

    llm.engine.runner.execute_decode_rows = third_fails
    (done,) = llm.generate(["Count to twenty please."], greedy)
    assert done.finish_reason is FinishReason.ERROR and "planted failure" in done.error
    assert done.token_ids == want[:3], "the tokens of the steps launched before the failure, the last one included"
    assert not llm.engine.kv.seqs and not llm.engine.has_unfinished_requests()
