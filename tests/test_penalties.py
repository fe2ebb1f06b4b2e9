"""The logit adjustments and min-p: `SamplingParams` validation of the new knobs, exact values of logit_bias and the
repetition / frequency / presence penalties on hand-made logits, what the sampler does with them (greedy takes the
adjusted argmax, logprobs stay raw), the work a step without them does (none), and the kept set of the top-k /
top-p / min-p filters against HF transformers' own warpers, applied in HF's order."""

from __future__ import annotations

import pytest
import torch

from prism.engine import penalty_counts
from prism.engine.penalties import TokenHistory, adjusted_logits
from prism.engine.penalty_counts import CountsSlot, PenaltyCounts, PenaltyTableFull, PenaltyTableOutOfMemory
from prism.engine.sampler import SamplerError, filtered_distribution, make_generator, sample
from prism.engine.sampling import MAX_LOGIT_BIAS_TOKENS, SamplingParams, SamplingParamsError
from prism.ops import host_copy

greedy = SamplingParams.greedy

# ---------------------------------------------------------------------------------------- SamplingParams


def test_defaults_are_off_and_a_bias_mapping_is_kept_sorted():
    p = SamplingParams()
    assert (p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.logit_bias) == (0, 1, 0, 0, ())
    assert not p.has_penalties and not p.adjusts_logits
    q = SamplingParams(logit_bias={9: 1, 2: -100}, presence_penalty=1)
    assert q.logit_bias == ((2, -100.0), (9, 1.0)) and isinstance(q.presence_penalty, float)
    assert q.has_penalties and q.adjusts_logits and hash(q)
    assert q.with_(max_tokens=3).logit_bias == q.logit_bias, "a normalised bias survives with_"
    assert SamplingParams(logit_bias={1: 5}).adjusts_logits and not SamplingParams(logit_bias={1: 5}).has_penalties


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"min_p": float("nan")}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": "1.1"}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": -2.01}, "presence_penalty must be in [-2, 2]"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {True: 1.0}}, "logit_bias keys must be token ids"),
    # a bad key among unsorted ids is named itself, not as a repeat of an id it made unsorted
    ({"logit_bias": {5: 1.0, 3: 1.0, "x": 1.0}}, "logit_bias keys must be token ids (integers >= 0), got 'x'"),
    ({"logit_bias": {5: 100.5}}, "logit_bias of token 5 must be in [-100, 100]"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias of token 5"),
    ({"logit_bias": ((5, 1.0), (5, 2.0))}, "token id 5 more than once"),
    ({"logit_bias": 5}, "logit_bias must be a mapping"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}}, "at most"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**kwargs)
    assert words in str(caught.value), caught.value


def test_limits_are_inclusive():
    SamplingParams(min_p=1.0, frequency_penalty=-2, presence_penalty=2, logit_bias={0: -100, 3: 100})
    SamplingParams(repetition_penalty=1e-3, min_p=0.0)


# ---------------------------------------------------------------------------------------- exact values

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, -2.0]])


def adjust(params: SamplingParams, prompt=(), output=()) -> list[float]:
    return adjusted_logits(LOGITS.clone(), [params], [TokenHistory(list(prompt), list(output))])[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # seen: 0 (prompt), 1 (prompt), 3 (output), 4 (output, logit 0); unseen 2 and 5 keep theirs
    got = adjust(SamplingParams(repetition_penalty=2.0), prompt=[1, 0, 1], output=[3, 4])
    assert got == [1.0, -2.0, 0.5, 1.5, 0.0, -2.0]
    r = torch.tensor(1.3)  # a penalty that does not divide exactly: the fp32 quotient, as HF computes it
    got = adjust(SamplingParams(repetition_penalty=1.3), prompt=[0, 1])
    assert got[:2] == [(torch.tensor(2.0) / r).item(), (torch.tensor(-1.0) * r).item()] and got[2:] == LOGITS[0, 2:].tolist()


def test_frequency_and_presence_penalties_read_the_output_only():
    got = adjust(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), prompt=[0, 2, 5], output=[3, 3, 3, 1])
    assert got == [2.0, -1.0 - 0.5 - 1.0, 0.5, 3.0 - 1.5 - 1.0, 0.0, -2.0], "prompt tokens 0, 2, 5 are not penalized"
    negative = adjust(SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5), output=[4, 4])
    assert negative == [2.0, -1.0, 0.5, 3.0, 2.5, -2.0], "negative penalties encourage repeats"


def test_logit_bias_is_added_before_the_penalties():
    got = adjust(SamplingParams(logit_bias={5: 7.0, 1: -100.0}, repetition_penalty=2.0), prompt=[5, 1])
    # 5: -2 + 7 = 5 > 0, divided: 2.5; 1: -1 - 100 = -101, multiplied: -202
    assert got == [2.0, -202.0, 0.5, 3.0, 0.0, 2.5]


def test_all_knobs_together_in_vllms_order():
    p = SamplingParams(logit_bias={0: 1.0}, repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    got = adjust(p, prompt=[2], output=[0, 0, 5])
    # 0: (2+1)/2 - 2*0.25 - 0.5 = 0.5; 2: 0.5/2 (prompt only); 5: -2*2 - 0.25 - 0.5
    assert got == [0.5, -1.0, 0.25, 3.0, 0.0, -4.75]


def test_a_row_without_knobs_is_untouched_and_nothing_runs_for_a_batch_without_them(monkeypatch):
    x = torch.randn(3, 6)
    params = [greedy(), SamplingParams(presence_penalty=1.0), greedy(logit_bias={2: 3.0})]
    out = adjusted_logits(x, params, [None, TokenHistory([], [0, 0]), None])
    assert torch.equal(out[0], x[0]) and out[1, 0] == x[1, 0] - 1.0 and out[2, 2] == x[2, 2] + 3.0
    assert torch.equal(x, x.clone()) and out is not x
    plain = [greedy(logprobs=1), SamplingParams(temperature=0.7, top_k=3, seed=1), SamplingParams(seed=2)]
    assert adjusted_logits(x, plain, [None] * 3) is x, "a step without the knobs gets its logits back as they are"
    copies = []
    to_device = host_copy.to_device
    monkeypatch.setattr(host_copy, "to_device", lambda *a, **k: copies.append(a) or to_device(*a, **k))
    alone = sample(x, plain, [make_generator(p) for p in plain])
    before, copies[:] = list(copies), []
    with_histories = sample(x, plain, [make_generator(p) for p in plain], [TokenHistory([1], [2])] * 3)
    assert len(copies) == len(before), "histories given to rows without penalties must cost no copy"
    assert torch.equal(alone.token_ids, with_histories.token_ids) and torch.equal(alone.logprobs, with_histories.logprobs)


def test_out_of_vocabulary_history_and_bias_ids_are_refused():
    with pytest.raises(SamplerError, match="outside the vocabulary"):
        adjusted_logits(LOGITS, [SamplingParams(presence_penalty=1.0)], [TokenHistory([], [6])])
    with pytest.raises(SamplerError, match="outside the vocabulary"):
        adjusted_logits(LOGITS, [SamplingParams(repetition_penalty=1.1)], [TokenHistory([-1], [])])
    with pytest.raises(SamplerError, match="logit_bias token id 6"):
        adjusted_logits(LOGITS, [greedy(logit_bias={6: 1.0})], [None])
    with pytest.raises(SamplerError, match="no TokenHistory"):
        sample(LOGITS, [SamplingParams(frequency_penalty=0.1)])
    with pytest.raises(SamplerError, match="token histories"):
        sample(LOGITS, [greedy()], None, [None, None])


# ---------------------------------------------------------------------------------------- in the sampler


def test_greedy_takes_the_adjusted_argmax_and_logprobs_stay_raw():
    params = [greedy(logprobs=2, presence_penalty=2.0), greedy(logprobs=2)]
    logits = LOGITS.expand(2, -1).contiguous()
    res = sample(logits, params, None, [TokenHistory([], [3]), None])
    assert res.token_ids.tolist() == [0, 3], "3 (3.0 - 2) loses to 0 (2.0); the unpenalized row keeps 3"
    raw = torch.log_softmax(LOGITS[0], dim=-1)
    assert torch.equal(res.logprobs, raw[[0, 3]]), "the chosen tokens' logprobs under the raw logits"
    assert res.top_token_ids.tolist() == [[3, 0], [3, 0]], "alternatives ranked by the raw logits"


def test_a_bias_of_minus_100_bans_and_plus_100_forces_a_sampled_token():
    logits = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(seed=i, logit_bias={3: -100.0}) for i in range(64)]
    banned = sample(logits, params, [make_generator(p) for p in params])
    assert 3 not in banned.token_ids.tolist()
    params = [SamplingParams(seed=i, temperature=1.5, logit_bias={4: 100.0}) for i in range(64)]
    assert set(sample(logits, params, [make_generator(p) for p in params]).token_ids.tolist()) == {4}


def test_min_p_keeps_the_tokens_within_its_fraction_of_the_most_likely():
    # tempered probabilities of [ln 8, ln 4, ln 2, ln 1] are 8:4:2:1; min_p = 0.3 keeps 8 and 4 (>= 2.4), drops 2 and 1
    x = torch.log(torch.tensor([[1.0, 8.0, 2.0, 4.0]]))
    probs, order = filtered_distribution(x, [SamplingParams(min_p=0.3)])
    kept = sorted(order[0][probs[0] > 0].tolist())
    assert kept == [1, 3]
    # at temperature 2 they are 2.83:2:1.41:1; min_p = 0.4 keeps those >= 1.13
    probs, order = filtered_distribution(x, [SamplingParams(min_p=0.4, temperature=2.0)])
    assert sorted(order[0][probs[0] > 0].tolist()) == [1, 2, 3]
    params = [SamplingParams(min_p=0.3, seed=i) for i in range(200)]
    drawn = sample(x.expand(200, -1).contiguous(), params, [make_generator(p) for p in params]).token_ids
    assert set(drawn.tolist()) == {1, 3}


@pytest.mark.parametrize("seed", range(12))
def test_the_kept_set_is_hfs_warpers_non_inf_set(seed):
    """Temperature, top-k, top-p, min-p: the tokens our filters keep are exactly those HF's warpers (in HF's order,
    from `_get_logits_processor`) leave finite, on random logits, each row its own knobs."""
    transformers = pytest.importorskip("transformers")
    from transformers import GenerationConfig

    gen = torch.Generator().manual_seed(seed)
    vocab = 50
    knobs = [(t, k, p, m) for t in (0.6, 1.0, 1.7) for k in (0, 7, 30) for p in (1.0, 0.9, 0.5) for m in (0.0, 0.05, 0.3)]
    x = torch.randn(len(knobs), vocab, generator=gen) * 2.5
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in knobs]
    filtered = [i for i, p in enumerate(params) if p.top_k or p.top_p < 1 or p.min_p]
    probs, order = filtered_distribution(x[filtered], [params[i] for i in filtered])
    ours = torch.zeros(len(filtered), vocab, dtype=torch.bool).scatter(1, order, probs > 0)
    model = transformers.GenerationMixin
    for row, i in enumerate(filtered):
        t, k, p, m = knobs[i]
        config = GenerationConfig(do_sample=True, temperature=t, top_k=k, top_p=p, min_p=m or None)
        warpers = model._get_logits_processor(_HFStub(), config, input_ids_seq_length=1, device="cpu")
        theirs = torch.isfinite(warpers(torch.zeros(1, 1, dtype=torch.long), x[i : i + 1].clone()))[0]
        assert torch.equal(ours[row], theirs), (knobs[i], ours[row].nonzero().tolist(), theirs.nonzero().tolist())


class _HFStub:
    """What `GenerationMixin._get_logits_processor` reads of the model when only warpers are configured."""

    def _merge_criteria_processor_list(self, default, custom):
        return default


# ---------------------------------------------------------------------------------------- the count table


def test_a_kept_slot_counts_only_the_new_tokens_and_a_bad_one_changes_nothing():
    table, slot = PenaltyCounts("cpu", 6, slots=1), CountsSlot()
    output = [3, 3]
    p = SamplingParams(frequency_penalty=1.0)
    first = adjusted_logits(LOGITS, [p], [TokenHistory([], output, slot)], table)
    assert first[0, 3] == 1.0 and slot.counted == 2 and table.in_use == 1
    output.append(6)  # outside the vocabulary: refused before the table changes
    with pytest.raises(SamplerError, match="outside the vocabulary"):
        adjusted_logits(LOGITS, [p], [TokenHistory([], output, slot)], table)
    assert slot.counted == 2 and table.counts[slot.index].tolist() == [0, 0, 0, 2, 0, 0]
    output[-1] = 1
    output.extend([1, 3])  # more than one token since the last sample (a preemption, the step in flight)
    got = adjusted_logits(LOGITS, [p], [TokenHistory([], output, slot)], table)
    assert got[0].tolist() == [2.0, -3.0, 0.5, 0.0, 0.0, -2.0]
    assert table.counts[slot.index].tolist() == [0, 2, 0, 3, 0, 0]


def test_a_slot_is_refilled_when_its_history_is_shorter_and_rows_without_one_come_back():
    table, slot = PenaltyCounts("cpu", 6, slots=2), CountsSlot()
    p = SamplingParams(presence_penalty=1.0, repetition_penalty=2.0)
    adjusted_logits(LOGITS, [p], [TokenHistory([0], [1, 1, 2], slot)], table)
    got = adjusted_logits(LOGITS.expand(2, -1), [p, p], [TokenHistory([5], [4], slot), TokenHistory([], [0, 3])], table)
    assert got[0].tolist() == [2.0, -1.0, 0.5, 3.0, -1.0, -4.0], "the row counts its new, shorter history only"
    assert got[1].tolist() == [0.0, -1.0, 0.5, 0.5, 0.0, -2.0]
    assert table.in_use == 1, "the row without a slot took a row for its step, then gave it back"
    slot.release()
    assert table.in_use == 0 and slot.table is None


def test_a_table_for_other_logits_is_refused():
    with pytest.raises(SamplerError, match="count table of 7 tokens"):
        adjusted_logits(LOGITS, [SamplingParams(presence_penalty=1.0)], [TokenHistory([], [1])],
                        PenaltyCounts("cpu", 7, slots=1))


def test_the_table_is_allocated_whole_once_and_never_grows(caplog):
    table = PenaltyCounts("cpu", 6, slots=2)
    assert table.counts is None and table.nbytes == 3 * 6 * 5, "nothing allocated before a penalized row samples"
    p = SamplingParams(presence_penalty=1.0)
    slots = [CountsSlot() for _ in range(3)]
    with caplog.at_level("INFO", logger="prism.engine.penalty_counts"):
        adjusted_logits(LOGITS, [p], [TokenHistory([], [1], slots[0])], table)
    assert table.counts.shape == table.prompt_seen.shape == (3, 6)
    assert [r.getMessage() for r in caplog.records] == [
        "penalty count table allocated on cpu: 2 slots + 1 x 6 tokens x 5 bytes = 90 bytes (0.0 MiB)"]
    counts = table.counts
    adjusted_logits(LOGITS.expand(2, -1), [p, p], [TokenHistory([], [1], slots[0]), TokenHistory([], [2], slots[1])],
                    table)
    assert table.counts is counts and table.in_use == 2
    with pytest.raises(PenaltyTableFull, match="takes 1 slots of the penalty count table, 0 of its 2 are free"):
        adjusted_logits(LOGITS, [p], [TokenHistory([], [3], slots[2])], table)
    slots[0].release()
    got = adjusted_logits(LOGITS, [p], [TokenHistory([], [3, 4], slots[2])], table)
    assert got[0].tolist() == [2.0, -1.0, 0.5, 2.0, -1.0, -2.0] and table.counts is counts and table.in_use == 2


def test_a_table_the_device_has_no_room_for_is_a_typed_error(monkeypatch):
    table = PenaltyCounts("cpu", 6, slots=4)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 608.00 KiB")

    monkeypatch.setattr(penalty_counts.torch, "zeros", out_of_memory)
    slot = CountsSlot()
    with pytest.raises(PenaltyTableOutOfMemory, match=r"no room on cpu for the penalty count table \(0.0 MiB: 4 "
                                                       r"slots \(max_num_seqs\) \+ 1, x 6 tokens x 5 bytes\)"):
        adjusted_logits(LOGITS, [SamplingParams(presence_penalty=1.0)], [TokenHistory([], [1], slot)], table)
    assert table.counts is None and table.in_use == 0 and slot.table is None, "nothing kept: the next sample retries"
    monkeypatch.undo()
    got = adjusted_logits(LOGITS, [SamplingParams(presence_penalty=1.0)], [TokenHistory([], [1], slot)], table)
    assert got[0, 1] == LOGITS[0, 1] - 1 and table.in_use == 1
