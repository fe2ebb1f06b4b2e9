"""The logit adjustments in the engine (tiny checkpoint, CPU, fp32 weights): greedy decoding with a repetition
penalty is HF `generate`'s token for token (text and images: the prompt's image tokens are penalized too); a
penalized request's history is complete under async scheduling (the token of the step in flight included), after
a preemption and a swap, and beside requests with other knobs or none; each holds a row of the count table while it
runs and gives it back however it ends; a logit_bias id outside the vocabulary is refused when the request is
added."""

from __future__ import annotations

import pytest
import torch
from test_engine import IMAGES, _one_thread, chat, hf_greedy  # noqa: F401 (_one_thread: an autouse fixture)

from prism.engine.llm import LLM
from prism.engine.penalty_counts import PenaltyCounts, PenaltyTableOutOfMemory
from prism.engine.request import FinishReason, Request, RequestState
from prism.engine.sampling import SamplingParams, SamplingParamsError
from prism.testing.checkpoints import ensure_tiny_checkpoint

PROMPTS = ["Tell me a story about paged attention.", "Count to twenty please.", "What is two plus two?",
           "Name three colours, please."]


@pytest.mark.parametrize("case", ["text", "images"])
def test_greedy_with_a_repetition_penalty_matches_hf_generate(case):
    ckpt = ensure_tiny_checkpoint()
    from transformers import Qwen3VLForConditionalGeneration

    hf_model = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    llm = LLM(ckpt, kv_dtype="fp32", page_size=4, num_gpu_pages=128, max_num_batched_tokens=96, check_invariants=True)
    messages = chat(PROMPTS[0]) if case == "text" else chat(IMAGES[1], "Describe it.")
    prompt = llm.engine.inputs.prepare_chat(messages)
    expected = hf_greedy(hf_model, prompt, 32, repetition_penalty=1.3)
    (ours,) = llm.generate([prompt], SamplingParams.greedy(max_tokens=32, ignore_eos=True, repetition_penalty=1.3))
    assert len(expected) >= 8, f"HF stopped early: {expected}"
    assert ours.token_ids[: len(expected)] == expected, f"{case}: ours {ours.token_ids} vs HF {expected}"
    (plain,) = llm.generate([prompt], SamplingParams.greedy(max_tokens=32, ignore_eos=True))
    assert plain.token_ids != ours.token_ids, "the penalty must change this generation, or the test shows nothing"


def mixed_params(max_tokens: int) -> list[SamplingParams]:
    """A presence-penalized greedy request beside others: frequency + bias, seeded repetition + min_p, none."""
    return [
        SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True, presence_penalty=2.0, logprobs=1),
        SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True, frequency_penalty=1.0, logit_bias={364: -100}),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=5, repetition_penalty=1.5, min_p=0.1),
        SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True, logprobs=1),
    ]


def test_async_scheduling_gives_a_penalized_request_its_whole_history():
    """With async scheduling each step is sampled after the step in flight's tokens were appended: greedy with a
    large presence penalty never repeats a token it emitted, and every request's tokens and logprobs are those of
    the engine that reads each step's tokens before launching the next."""
    ckpt = ensure_tiny_checkpoint()
    common = dict(kv_dtype="fp8", page_size=16, num_gpu_pages=64, graph_rows_without_cuda=True, check_invariants=True)
    params = mixed_params(40)
    want = LLM(ckpt, async_scheduling=False, **common).generate(PROMPTS, params)
    llm = LLM(ckpt, **common)
    got = llm.generate(PROMPTS, params)
    assert llm.engine.stats.async_steps > 20, llm.engine.stats
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        if g.logprobs is not None:
            assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-5)
    penalized, plain = got[0].token_ids, got[3].token_ids
    assert len(set(penalized)) == len(penalized), f"a presence penalty of 2 repeated a token: {penalized}"
    assert len(set(plain)) < len(plain), "without the penalty the tiny model repeats itself: the test needs that"
    assert 364 not in got[1].token_ids


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_preempted_request_keeps_its_history(preemption):
    """A pool too small for four growing requests: each preempted one resumes with its prompt and every token it
    had output, so its penalized tokens are those of a pool where nobody was preempted."""
    ckpt = ensure_tiny_checkpoint()
    # fp32 KV: with FP8 KV a recomputed sequence's logits differ from the decoded ones' (without any knob, up to 1.5
    # in a logprob here), enough to move a seeded draw; this test is about the history, not the KV's rounding
    common = dict(kv_dtype="fp32", page_size=4, max_num_batched_tokens=160, max_num_seqs=4, check_invariants=True)
    params = mixed_params(24)
    want = [c.token_ids for c in LLM(ckpt, num_gpu_pages=256, **common).generate(PROMPTS, params)]
    swap = dict(num_cpu_pages=64, preemption="swap") if preemption == "swap" else {}
    llm = LLM(ckpt, num_gpu_pages=24, **swap, **common)
    got = [c.token_ids for c in llm.generate(PROMPTS, params)]
    assert llm.engine.stats.preemptions > 0, "the scenario must preempt"
    assert got == want


def test_a_logit_bias_id_outside_the_vocabulary_is_refused():
    ckpt = ensure_tiny_checkpoint()
    llm = LLM(ckpt, kv_dtype="fp32", page_size=16, num_gpu_pages=32)
    vocab = llm.engine.runner.model.config.text.vocab_size
    with pytest.raises(SamplingParamsError, match=f"logit_bias token ids must be below the vocabulary size {vocab}"):
        llm.generate(["Hi"], SamplingParams.greedy(max_tokens=2, logit_bias={5: 1.0, vocab: 2.0}))
    assert not llm.engine.has_unfinished_requests()
    (done,) = llm.generate(["Hi"], SamplingParams.greedy(max_tokens=2, logit_bias={vocab - 1: 1.0}))
    assert len(done.token_ids) >= 1


def test_every_slot_goes_back_however_its_request_ends():
    """Penalized requests hold one row of the count table each while they run (not while preempted: each preemption
    gives it back), and give it back when they end: at their budget, or aborted mid-way."""
    ckpt = ensure_tiny_checkpoint()
    llm = LLM(ckpt, kv_dtype="fp32", page_size=4, num_gpu_pages=24, max_num_batched_tokens=160, max_num_seqs=4,
              async_scheduling=False)
    engine = llm.engine
    table = engine.penalty_counts
    assert table.slots == 4 and table.counts is None, "max_num_seqs slots, allocated when a penalized row samples"
    params = mixed_params(24)
    for i, (text, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"r{i}", text, p)
    held = steps = 0
    ends = {}
    while engine.has_unfinished_requests():
        ends.update((e.request_id, e.finish_reason) for e in engine.step() if e.finished)
        steps += 1
        holding = [r for r in engine.requests.values()
                   if r._penalty_counts is not None and r._penalty_counts.table is table]
        held = max(held, len(holding))
        assert table.in_use == len(holding), "a slot for each penalized request holding one"
        assert all(r.state is RequestState.RUNNING for r in holding), "a preempted request holds no slot"
        if steps == 6:
            engine.abort("r1")
    assert held == 3 and engine.stats.preemptions > 0, "the scenario must hold three slots and preempt"
    assert ends == {"r0": FinishReason.LENGTH, "r1": FinishReason.ABORT, "r2": FinishReason.LENGTH,
                    "r3": FinishReason.LENGTH}
    assert table.in_use == 0 and table.counts.shape == (5, engine.runner.model.config.text.vocab_size)


def test_no_request_is_preempted_while_a_step_that_sampled_it_is_in_flight(monkeypatch):
    """Async scheduling with swap and recompute preemptions: the engine preempts only in a scheduled step, which runs
    once the host has read every sampled token (a step scheduled ahead preempts no one), so a slot is never given
    back while a step that sampled its request is in flight (whose counts were gathered out of the table when it
    sampled, on the stream every later write to that row follows). Its tokens are those of a pool too large to
    preempt."""
    ckpt = ensure_tiny_checkpoint()
    common = dict(kv_dtype="fp32", page_size=4, max_num_batched_tokens=160, max_num_seqs=4,
                  graph_rows_without_cuda=True)
    params = mixed_params(24)
    want = [c.token_ids for c in LLM(ckpt, num_gpu_pages=256, async_scheduling=False, **common).generate(
        PROMPTS, params)]
    llm = LLM(ckpt, num_gpu_pages=24, num_cpu_pages=8, preemption="swap", **common)
    engine = llm.engine
    in_flight_when_preempted = []
    transition = Request.transition

    def recording(self, new):
        if new in (RequestState.WAITING, RequestState.SWAPPED):
            step = engine._inflight
            in_flight_when_preempted.append(step is not None and any(s.request is self for s in step.sampled))
        transition(self, new)

    monkeypatch.setattr(Request, "transition", recording)
    got = [c.token_ids for c in llm.generate(PROMPTS, params)]
    assert engine.stats.async_steps > 10 and in_flight_when_preempted, (engine.stats, "the scenario must preempt")
    assert not any(in_flight_when_preempted)
    assert got == want
    assert engine.penalty_counts.in_use == 0


def test_a_table_the_device_has_no_room_for_fails_only_the_penalized_requests(monkeypatch):
    """The count table is allocated when a penalized request first samples; if the device has no room for it then,
    that step's penalized requests fail with the typed error (the others sample as they would have), and a later
    penalized request tries again."""
    ckpt = ensure_tiny_checkpoint()
    llm = LLM(ckpt, kv_dtype="fp32", page_size=16, num_gpu_pages=64, max_num_seqs=4)
    params = mixed_params(8)
    want = [c.token_ids for c in llm.generate(PROMPTS, params)]
    llm = LLM(ckpt, kv_dtype="fp32", page_size=16, num_gpu_pages=64, max_num_seqs=4)
    allocate = PenaltyCounts._allocate

    def out_of_memory(self):
        raise PenaltyTableOutOfMemory("no room on cpu for the penalty count table (planted)")

    monkeypatch.setattr(PenaltyCounts, "_allocate", out_of_memory)
    got = llm.generate(PROMPTS, params)
    assert [c.finish_reason for c in got] == [FinishReason.ERROR] * 3 + [FinishReason.LENGTH]
    assert all(c.error == "PenaltyTableOutOfMemory: no room on cpu for the penalty count table (planted)"
               and not c.token_ids for c in got[:3])
    assert got[3].token_ids == want[3], "the request without penalties samples as it would have"
    assert llm.engine.penalty_counts.in_use == 0 and not llm.engine.has_unfinished_requests()
    monkeypatch.setattr(PenaltyCounts, "_allocate", allocate)
    assert [c.token_ids for c in llm.generate(PROMPTS[:1], params[:1])] == want[:1]
