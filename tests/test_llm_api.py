"""The offline API's edges (`prism.engine.llm`): a refused prompt refuses the whole `generate` and leaves nothing
running; `n` above 1 is refused, not silently one; a stream starts when it is made and is aborted when closed or
dropped early. (Event routing between calls: `specs/spec_llm_event_routing.py`.)"""

from __future__ import annotations

import gc

import pytest

from prism.engine.chat import InputError
from prism.engine.engine import RequestError
from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=128)


def settled(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert not llm.engine.requests and not llm.engine.kv.seqs and not llm._mailboxes


def test_a_refused_prompt_refuses_the_call_and_leaves_nothing_running(llm):
    with pytest.raises(InputError, match="empty"):
        llm.generate(["Tell me a story.", ""], SamplingParams(max_tokens=50))
    assert not llm.engine.requests, "the prompt before the refused one was left queued"
    settled(llm)


def test_images_past_the_engines_pixel_budget_refuse_the_call(llm):
    """`max_image_pixels` is an engine config key (2**28 by default): the offline API refuses a prompt whose images
    announce more, before any is decoded, and leaves nothing running."""
    import numpy as np

    from prism.media.errors import ImagePixelBudgetError

    assert llm.engine.inputs.max_image_pixels == llm.engine.config.max_image_pixels == 2**28
    small = LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=64, max_image_pixels=32 * 32)
    picture = np.zeros((32, 32, 3), np.uint8)
    chat = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "image", "image": picture},
                                         {"type": "text", "text": "Two?"}]}]
    with pytest.raises(ImagePixelBudgetError, match="2048 pixels in all; the limit is max_image_pixels=1024"):
        small.generate([chat], GREEDY)
    settled(small)
    assert len(small.engine.inputs.cache) == 0
    (answer,) = small.generate([[{"role": "user", "content": chat[0]["content"][1:]}]], GREEDY)
    assert len(answer.token_ids) == GREEDY.max_tokens


def test_n_above_one_is_refused(llm):
    with pytest.raises(RequestError, match="n=3"):
        llm.generate(["Hi"], SamplingParams(max_tokens=4, n=3))
    settled(llm)


def test_a_stream_starts_when_made(llm):
    (alone,) = llm.generate(["Count to ten:"], GREEDY)
    stream = llm.stream("Count to ten:", GREEDY)
    llm.generate(["Hi"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # steps the stream too
    assert llm._mailboxes[stream.request_id], "the stream's request did not run beside the generate"
    events = list(stream)
    assert [t for e in events for t in e.new_token_ids] == alone.token_ids and events[-1].finished
    assert list(stream) == [], "a finished stream yields nothing more"
    settled(llm)


@pytest.mark.parametrize("how", ["close", "drop", "context"])
def test_a_stream_left_early_is_aborted(llm, how):
    stream = llm.stream("Tell me a story.", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(stream)
    request_id = stream.request_id
    if how == "close":
        stream.close()
    elif how == "drop":  # aborted before the LLM's next step (a finalizer may run inside a step)
        del stream
        gc.collect()
        llm.generate(["Hi"], SamplingParams(max_tokens=1))
    else:
        with stream:
            pass
    assert request_id not in llm.engine.requests, f"the request outlived its stream ({how})"
    settled(llm)


def test_a_stream_finalized_inside_a_step_fails_no_request(llm):
    """Review (session 27): a stream dropped inside a reference cycle is finalized whenever the cyclic collector
    runs, possibly inside an engine step; its abort then released a sequence the step was using and failed the whole
    step (another stream ended with a KeyError). Its abort now waits for the LLM's next step."""
    a = llm.stream("Tell me a story about a cat.", GREEDY)
    b = llm.stream("Name three colours, please.", GREEDY)

    class Holder:
        pass

    holder = Holder()
    holder.stream, holder.me = b, holder  # b lives in a cycle: only the collector frees it
    del b, holder
    engine, execute = llm.engine, llm.engine.runner.execute
    collected = []

    def collect_inside(*args, **kwargs):
        if not collected:
            collected.append(gc.collect())  # the collector running during the step's allocations
        return execute(*args, **kwargs)

    gc.disable()
    engine.runner.execute = collect_inside
    try:
        events = list(a)
    finally:
        engine.runner.execute = execute
        gc.enable()
    assert collected and events[-1].finish_reason.value == "length" and events[-1].error is None, events[-1]
    settled(llm)


def test_prompts_and_params_of_the_wrong_shape_are_refused_with_what_is_accepted(llm):
    """Review (session 28): `generate(message)` (one dict) generated its keys "role" and "content" as two prompts,
    and other shapes (a tuple of messages, None, an int, params as a dict) failed deep in the engine with an
    AttributeError."""
    from prism.engine.engine import RequestError

    message = {"role": "user", "content": "Describe the weather"}
    three = SamplingParams(max_tokens=3)
    for prompts, params, words in (
        (message, three, "one chat message is not a prompt"),
        ([(message,)], three, "a prompt is a PreparedPrompt"),
        ([[message, "text"]], three, "list of dicts"),
        (None, three, "an iterable of prompts"),
        (7, three, "an iterable of prompts"),
        ([[message]], {"max_tokens": 3}, "must be a SamplingParams"),
        ([[message]], SamplingParams(max_tokens=3, stop_token_ids=(10**9,)), "below the vocabulary size"),
    ):
        with pytest.raises(RequestError, match=words):
            llm.generate(prompts, params)
        assert not llm.engine.requests, "a refused call leaves nothing running"
    with pytest.raises(RequestError, match="a prompt is a PreparedPrompt"):
        llm.stream(b"bytes", three)
    (done,) = llm.generate(([message] for _ in range(1)), three)  # any iterable of prompts
    assert done.finish_reason is not None and done.error is None


def test_video_frames_as_encoded_images_and_in_the_servers_form(llm):
    """Review (session 28): offline, video frames given as PNG bytes were refused with "video frame 0 must be
    bytes, a PIL image or a uint8 array, got bytes", and the server's part form ({"video": {"frames", "fps"}}) with
    "video part needs 'fps'". Both read as the same frames given as PIL images."""
    import io

    import numpy as np
    from PIL import Image

    def png(seed: int) -> bytes:
        out = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(out, "PNG")
        return out.getvalue()

    encoded = [png(i) for i in range(4)]
    decoded = [Image.open(io.BytesIO(f)).convert("RGB") for f in encoded]
    greedy = SamplingParams(max_tokens=3, temperature=0)

    def ask(part: dict) -> tuple[list[int], int]:
        (out,) = llm.generate([[{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]], greedy)
        assert out.error is None, out.error
        return out.token_ids, out.prompt_tokens

    want = ask({"type": "video", "video": decoded, "fps": 2.0})
    assert ask({"type": "video", "video": encoded, "fps": 2.0}) == want
    assert ask({"type": "video", "video": {"frames": encoded, "fps": 2.0}}) == want


@pytest.mark.parametrize("stop, text", [("\ufffd", "ok "), ("k \ufffd", "o"), ("zzz", "ok \ufffd")])
def test_a_stop_string_completed_by_the_last_flush_stops_as_one_completed_mid_stream(llm, stop, text):
    """The budget ends the request inside a character ("쀍" one byte short): the stream held it back, and its flush
    gives the U+FFFD that completes the stop string. It must end as a stop string completed mid-stream ends: the text
    cut before it, finish reason "stop", the offline result and the stream alike (it ended with "length")."""
    from prism.engine.request import FinishReason
    from prism.testing.scripted_tokens import scripted_tokens

    tok = llm.engine.inputs.tokenizer
    body = tok.encode("ok 쀍").ids[:-1]
    params = SamplingParams(max_tokens=len(body), temperature=0.0, ignore_eos=True, stop=(stop,))
    want = FinishReason.LENGTH if stop == "zzz" else FinishReason.STOP
    with scripted_tokens(llm.engine, lambda request_id: body):
        (out,) = llm.generate(["Hi"], params)
        events = list(llm.stream("Hi", params))
    assert (out.text, out.finish_reason, out.token_ids) == (text, want, body)
    assert ("".join(e.new_text for e in events), events[-1].finish_reason) == (text, want)
    settled(llm)
