"""The OpenAI wire format (prism.serving.protocol, prism.serving.stream): what the official client sends validates, bad fields are
refused with their name, sampling knobs map onto SamplingParams, and every response / chunk / error parses
with the `openai` package's own models (including through the official client itself, over a MockTransport)."""

from __future__ import annotations

import copy
import json
import math

import httpx
import openai
import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion as OAChatCompletion
from openai.types.chat import ChatCompletionChunk as OAChunk

from prism.engine.request import FinishReason, RequestOutput, TokenLogprobs
from prism.engine.sampling import SamplingParams
from prism.serving.media_urls import ForbiddenMedia, MediaTooLarge
from prism.serving.protocol import (
    ChatCompletionRequest,
    ProtocolError,
    describe_validation_errors,
    parse_chat_request,
)
from prism.serving.responses import (
    SSE_DONE,
    ModelCard,
    ModelList,
    RequestFailedError,
    error_body,
    error_from_exception,
    sse,
)
from prism.serving.stream import (
    ChatCompletionStream,
    build_response,
    chunk_from_output,
    openai_finish_reason,
)

PNG_URL = "data:image/png;base64,iVBORw0KGgo="  # never decoded here: only the shape matters

GOOD = {
    "model": "prism-tiny",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in English."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in the picture?"},
                {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "high"}},
                {"type": "video", "video": {"frames": [PNG_URL, PNG_URL], "fps": 2.0}},
            ],
            "name": "alice",
        },
        # an assistant message as the official client echoes a response message back
        {"role": "assistant", "content": "A cat.", "refusal": None, "annotations": [], "tool_calls": None},
        {"role": "user", "content": "And the video?"},
    ],
    "temperature": 0.7,
    "top_p": 0.9,
    "seed": 7,
    "stop": ["\n\n", "END"],
    "max_tokens": 32,
    "n": 2,
    "stream": True,
    "stream_options": {"include_usage": True},
    "logprobs": True,
    "top_logprobs": 3,
    # fields the official client may send that change nothing here
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": False,
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "parallel_tool_calls": False,
    "service_tier": "auto",
    # extensions
    "top_k": 20,
    "ignore_eos": True,
    "stop_token_ids": [5, 6],
}


def with_(base: dict, **changes) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DROP = object()


# ------------------------------------------------------------------------------------------ requests
def test_full_request_validates_and_maps_to_sampling_params():
    req = parse_chat_request(GOOD)
    assert [m.role for m in req.messages] == ["system", "developer", "user", "assistant", "user"]
    assert req.include_usage and req.num_choices == 2
    assert [type(p).__name__ for p in req.media_parts()] == ["ImageURLPart", "VideoPart"]
    # raw JSON bytes give the same model as the parsed dict
    assert parse_chat_request(json.dumps(GOOD).encode()) == req
    sp = req.to_sampling_params(default_max_tokens=100)
    assert sp == SamplingParams(
        max_tokens=32,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=7,
        stop=("\n\n", "END"),
        stop_token_ids=(5, 6),
        ignore_eos=True,
        logprobs=3,
        n=2,
    )


def test_minimal_request_gets_openai_defaults():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    sp = req.to_sampling_params(default_max_tokens=77)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.n) == (1.0, 1.0, 0, 77, 1)
    assert sp.logprobs is None and sp.stop == () and sp.seed is None and not sp.ignore_eos
    assert not req.include_usage and not req.stream
    assert not sp.adjusts_logits and sp.min_p == 0.0, "no penalty, bias or min-p unless asked"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 10}, 10),
        ({"max_completion_tokens": 12}, 12),
        ({"max_tokens": 10, "max_completion_tokens": 12}, 12),
        ({"max_tokens": 50, "max_completion_tokens": 3}, 3),
        ({"max_tokens": None, "max_completion_tokens": None}, 99),
    ],
)
def test_max_completion_tokens_wins(fields, expected):
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})
    assert req.to_sampling_params(99).max_tokens == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 20}, 20),
    ],
)
def test_logprobs_mapping(fields, expected):
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})
    assert req.to_sampling_params(8).logprobs == expected


def test_single_stop_string_and_greedy():
    req = parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": "###", "temperature": 0}
    )
    sp = req.to_sampling_params(8)
    assert sp.stop == ("###",) and sp.is_greedy


def test_a_negative_seed_is_its_unsigned_64_bit_pattern():
    """OpenAI's seed is a signed 64-bit integer (vLLM accepts the same range): -1 seeds as 2**64 - 1, so two requests
    with seed -1 sample alike and unlike seed 1."""
    for seed, expected in ((-1, 2**64 - 1), (-(2**63), 2**63), (5, 5), (2**64 - 1, 2**64 - 1)):
        assert parse_chat_request({**GOOD, "seed": seed}).to_sampling_params(8).seed == expected


BAD_CASES = [
    # (changes to GOOD, param named, substring of the message)
    ({"temperature": "0.5"}, "temperature", "valid number"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"seed": -(2**63) - 1}, "seed", "greater than or equal to -9223372036854775808"),
    ({"seed": 2**64}, "seed", "less than or equal to"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 1.5}, "max_tokens", "valid integer"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens", "valid integer"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 129}, "n", "less than or equal to 128"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"stream": False}, "stream_options", "only allowed when stream is true"),
    ({"logprobs": False}, "top_logprobs", "requires logprobs"),
    ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"stop": 5}, "stop", "string or a list of strings"),
    ({"stop": ["ok", ""]}, "stop", "must not be empty"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "greater than or equal to 0"),
    ({"ignore_eos": 1}, "ignore_eos", "valid boolean"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
    ({"presence_penalty": -2.1}, "presence_penalty", "greater than or equal to -2"),
    ({"presence_penalty": "1.5"}, "presence_penalty", "valid number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_p": 1.1}, "min_p", "less than or equal to 1"),
    ({"min_p": -0.1}, "min_p", "greater than or equal to 0"),
    ({"logit_bias": {"42": 101}}, "logit_bias", "bias of token 42 must be in [-100, 100]"),
    ({"logit_bias": {"4x": 1}}, "logit_bias", "token ids written in digits"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids written in digits"),
    ({"logit_bias": {"7": 1, "007": 2}}, "logit_bias", "token id 7 is given twice"),
    ({"logit_bias": {"7": "1"}}, "logit_bias.7", "valid number"),
    ({"response_format": {"type": "json_object"}}, "response_format.type", "'text'"),
    ({"tools": [{"type": "function"}]}, "tools", "unknown or unsupported field"),
    ({"model": ""}, "model", "at least 1 character"),
    ({"model": _DROP}, "model", "Field required"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "role must be one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "Field required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or a non-empty list"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "at least 1 item"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra", "unknown"),
    (
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
        "messages[0].tool_calls",
        "at most 0 items",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages[0].content[0]",
        "unknown content part type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]},
        "messages[0].content[0].image_url.url",
        "valid string",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "max"}}],
                }
            ]
        },
        "messages[0].content[0].image_url.detail",
        "'auto', 'low' or 'high'",
    ),
    (
        {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
        "only text parts",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "video", "video": {"frames": ["a"], "fps": 0}}]}
            ]
        },
        "messages[0].content[0].video.fps",
        "greater than 0",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "video", "video": {"frames": [], "fps": 1}}]}]},
        "messages[0].content[0].video.frames",
        "at least 1 item",
    ),
]


@pytest.mark.parametrize(("changes", "param", "text"), BAD_CASES)
def test_bad_fields_are_refused_with_their_name(changes, param, text):
    body = with_(GOOD, **changes)
    with pytest.raises(ProtocolError) as info:
        parse_chat_request(body)
    err = info.value
    assert err.status == 400
    assert err.param == param, str(err)
    assert str(err).startswith(f"{param}: ") and text in str(err), str(err)
    # the raw-JSON path reports the same field (NaN is not JSON: skipped there)
    if not any(isinstance(v, float) and math.isnan(v) for v in changes.values()):
        with pytest.raises(ProtocolError) as info_json:
            parse_chat_request(json.dumps(body))
        assert info_json.value.param == param


def test_invalid_json_and_fastapi_style_locations():
    with pytest.raises(ProtocolError, match="Invalid JSON"):
        parse_chat_request(b'{"model": ')
    # FastAPI prefixes body fields with "body"; the param stays OpenAI-style.
    msg, param = describe_validation_errors(
        [
            {
                "type": "float_type",
                "loc": ("body", "temperature"),
                "msg": "Input should be a valid number",
                "input": "x",
            }
        ]
    )
    assert param == "temperature" and msg == "temperature: Input should be a valid number (got 'x')"


# ------------------------------------------------------------------------------------------ events
def ev(text, ids, *, finished=False, reason=None, logprobs=None, prompt=5, cached=2, done=0, error=None):
    return RequestOutput(
        request_id="r",
        new_token_ids=ids,
        new_text=text,
        finished=finished,
        finish_reason=reason,
        error=error,
        logprobs=logprobs,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=done,
    )


def fake_token_bytes(token_id: int) -> bytes:
    return {1: b"Hel", 2: b"lo", 3: b"\xc3", 4: b"\xa9", 9: b"!"}.get(token_id, b"?")


def test_finish_reason_mapping():
    assert openai_finish_reason(FinishReason.STOP) == "stop"
    assert openai_finish_reason(FinishReason.LENGTH) == "length"
    assert openai_finish_reason(None) is None
    with pytest.raises(RequestFailedError, match="pool too small"):
        openai_finish_reason(FinishReason.ERROR, "pool too small")
    with pytest.raises(RequestFailedError, match="aborted"):
        openai_finish_reason(FinishReason.ABORT)


def test_response_json_is_openai_shaped():
    lp = [
        TokenLogprobs(1, -0.25, [(1, -0.25), (2, -float("inf"))]),
        TokenLogprobs(2, -1.5, [(2, -1.5), (9, -2.0)]),
    ]
    choice0 = [
        ev("Hel", [1], logprobs=lp[:1], done=1),
        ev("lo", [2], finished=True, reason=FinishReason.STOP, logprobs=lp[1:], done=2),
    ]
    choice1 = [
        ev("Hello", [1, 2], done=2, logprobs=[]),
        ev("!", [9], finished=True, reason=FinishReason.LENGTH, done=3, cached=4, logprobs=[]),
    ]
    resp = build_response("chatcmpl-1", 1700000000, "prism-tiny", [choice0, choice1], fake_token_bytes)
    raw = resp.model_dump_json()
    assert ", " not in raw and '": ' not in raw  # compact
    data = json.loads(raw)
    parsed = OAChatCompletion.model_validate(data)
    assert parsed.object == "chat.completion" and parsed.id == "chatcmpl-1" and parsed.created == 1700000000
    assert [c.message.content for c in parsed.choices] == ["Hello", "Hello!"]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    assert parsed.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 5,
        "completion_tokens": 5,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert set(data) == {"id", "object", "created", "model", "choices", "usage"}
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    first = parsed.choices[0].logprobs.content[0]
    assert (first.token, first.logprob, first.bytes) == ("Hel", -0.25, list(b"Hel"))
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [
        ("Hel", -0.25),
        ("lo", -9999.0),
    ]  # -inf clamped
    assert parsed.choices[1].logprobs.content == []


def test_response_without_logprobs_sends_null_and_errors_refuse():
    events = [ev("ok", [1], finished=True, reason=FinishReason.STOP, done=1)]
    data = json.loads(build_response("c", 1, "m", [events]).model_dump_json())
    assert data["choices"][0]["logprobs"] is None and "logprobs" in data["choices"][0]
    with pytest.raises(RequestFailedError, match="boom"):
        build_response("c", 1, "m", [[ev("", [], finished=True, reason=FinishReason.ERROR, error="boom")]])
    with pytest.raises(ValueError, match="not finished"):
        build_response("c", 1, "m", [[ev("x", [1])]])
    with pytest.raises(ValueError, match="token_bytes"):
        build_response(
            "c",
            1,
            "m",
            [[ev("x", [1], finished=True, reason=FinishReason.STOP, logprobs=[TokenLogprobs(1, -1.0, [])])]],
        )


def parse_sse(body: bytes) -> list:
    assert body.endswith(SSE_DONE)
    events = body.split(b"\n\n")
    assert events[-1] == b""
    out = []
    for e in events[:-1]:
        assert e.startswith(b"data: ")
        payload = e[len(b"data: ") :]
        out.append(None if payload == b"[DONE]" else json.loads(payload))
    assert out[-1] is None and None not in out[:-1]
    return out[:-1]


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_chunks_are_openai_shaped(include_usage):
    stream = ChatCompletionStream(
        "prism-tiny", n=2, include_usage=include_usage, token_bytes=fake_token_bytes, created=1700000001
    )
    lp = [TokenLogprobs(3, -0.5, [(3, -0.5)]), TokenLogprobs(4, -0.1, [(4, -0.1)])]
    body = stream.start()
    body += stream.on_output(0, ev("", [3], logprobs=lp[:1], done=1))  # held-back text, logprobs still sent
    body += stream.on_output(1, ev("A", [1], done=1))
    assert stream.on_output(1, ev("", [], done=1)) == b""  # nothing to send
    body += stream.on_output(
        0, ev("é", [4], finished=True, reason=FinishReason.STOP, logprobs=lp[1:], done=2)
    )
    assert not stream.finished
    with pytest.raises(ValueError, match="before every choice"):
        stream.finish()
    body += stream.on_output(1, ev("", [], finished=True, reason=FinishReason.LENGTH, done=1, cached=0))
    with pytest.raises(ValueError, match="already finished"):
        stream.on_output(1, ev("x", [1]))
    body += stream.finish()
    chunks = parse_sse(body)
    parsed = [OAChunk.model_validate(c) for c in chunks]
    assert all(
        c.id == stream.id and c.object == "chat.completion.chunk" and c.created == 1700000001 for c in parsed
    )
    # first chunk of each choice: role assistant, empty content; OpenAI sends null finish_reason / logprobs
    assert chunks[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert chunks[1]["choices"][0]["index"] == 1
    texts = {0: "", 1: ""}
    reasons = {}
    for c in parsed:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert texts == {0: "é", 1: "A"} and reasons == {0: "stop", 1: "length"}
    lp_tokens = [t for c in parsed for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.bytes for t in lp_tokens] == [[0xC3], [0xA9]]
    assert bytes(lp_tokens[0].bytes + lp_tokens[1].bytes).decode() == "é"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals[-1]["choices"][0]["delta"] == {}  # finish-only chunk: empty delta, as OpenAI
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 2},
        }
        # OpenAI: "All other chunks will also include a usage field, but with a null value" (session 27's review)
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    else:
        assert all("usage" not in c for c in chunks)


def test_stream_error_event_and_engine_error():
    stream = ChatCompletionStream("m")
    with pytest.raises(RequestFailedError, match="kaput"):
        stream.on_output(0, ev("", [], finished=True, reason=FinishReason.ERROR, error="kaput"))
    chunks = parse_sse(ChatCompletionStream.error(500, "kaput"))
    assert chunks == [
        {"error": {"message": "kaput", "type": "server_error", "param": None, "code": "internal_error"}}
    ]
    assert chunk_from_output("c", 1, "m", 0, ev("", [])) is None


def test_error_bodies():
    assert error_body(400, "bad", "temperature") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": None}
    }
    assert error_body(404, "no such model", "model", "model_not_found")["error"] == {
        "message": "no such model",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert error_body(404, "GET /nothing: Not Found")["error"]["code"] is None, "an unknown path is no model"
    assert error_body(413, "big")["error"]["code"] == "request_too_large"
    assert error_body(429, "busy")["error"]["code"] == "rate_limit_exceeded"
    assert error_body(503, "down")["error"]["type"] == "server_error"
    assert error_body(422, "x")["error"]["type"] == "invalid_request_error"
    assert (
        sse(error_body(400, "é"))
        == 'data: {"error":{"message":"é","type":"invalid_request_error","param":null,"code":null}}\n\n'.encode()
    )
    status, body = error_from_exception(ProtocolError("n: too big", "n"))
    assert (status, body["error"]["param"], body["error"]["message"]) == (400, "n", "n: too big")
    assert error_from_exception(ForbiddenMedia("no", param="messages[0]"))[0] == 403
    assert error_from_exception(MediaTooLarge("big"))[0] == 413
    assert error_from_exception(ValueError("plain"))[0] == 400
    status, body = error_from_exception(RuntimeError("secret internals"))
    assert status == 500 and "secret" not in body["error"]["message"]
    status, body = error_from_exception(RequestFailedError("RuntimeError: secret internals"))
    assert status == 500 and "secret" not in body["error"]["message"], "the engine's reason is for the log"


def test_model_list_shape():
    data = json.loads(ModelList(data=[ModelCard(id="prism-tiny", created=1)]).model_dump_json())
    assert data == {
        "object": "list",
        "data": [{"id": "prism-tiny", "object": "model", "created": 1, "owned_by": "prism"}],
    }
    Model.model_validate(data["data"][0])


# ------------------------------------------------------------------------------------------ official client
def _fake_server(seen: list):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(
                200, content=ModelList(data=[ModelCard(id="prism-tiny", created=3)]).model_dump_json()
            )
        try:
            req = parse_chat_request(request.content)
        except ProtocolError as exc:
            status, body = error_from_exception(exc)
            return httpx.Response(status, json=body)
        seen.append(req)
        n = req.num_choices
        events = [ev("Hi", [1], done=1), ev(" there", [2], finished=True, reason=FinishReason.STOP, done=2)]
        if req.stream:
            stream = ChatCompletionStream(
                req.model, n=n, include_usage=req.include_usage, token_bytes=fake_token_bytes
            )
            body = (
                stream.start()
                + b"".join(stream.on_output(i, e) for i in range(n) for e in events)
                + stream.finish()
            )
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)
        resp = build_response("chatcmpl-x", 5, req.model, [events] * n, fake_token_bytes)
        return httpx.Response(
            200, headers={"content-type": "application/json"}, content=resp.model_dump_json()
        )

    return handler


@pytest.fixture
def client_and_seen():
    seen: list = []
    http = httpx.Client(transport=httpx.MockTransport(_fake_server(seen)))
    client = openai.OpenAI(
        api_key="sk-test", base_url="http://prism.test/v1", http_client=http, max_retries=0
    )
    yield client, seen
    client.close()


def test_official_client_round_trip(client_and_seen):
    client, seen = client_and_seen
    out = client.chat.completions.create(
        model="prism-tiny",
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "auto"}},
                ],
            },
        ],
        max_completion_tokens=9,
        temperature=0,
        n=2,
        user="someone",
        seed=3,
        extra_body={"top_k": 5},
    )
    assert [c.message.content for c in out.choices] == ["Hi there", "Hi there"]
    assert out.usage.total_tokens == 5 + 4 and out.usage.prompt_tokens_details.cached_tokens == 2
    sp = seen[-1].to_sampling_params(100)
    assert (sp.max_tokens, sp.temperature, sp.n, sp.seed, sp.top_k) == (9, 0.0, 2, 3, 5)
    assert [m.id for m in client.models.list()] == ["prism-tiny"]


def test_official_client_penalties_min_p_and_logit_bias_reach_the_sampling_params(client_and_seen):
    """OpenAI's penalties and logit_bias as the client sends them, vLLM's min_p / repetition_penalty in extra_body."""
    client, seen = client_and_seen
    client.chat.completions.create(
        model="prism-tiny", messages=[{"role": "user", "content": "hi"}], presence_penalty=1.5,
        frequency_penalty=-0.5, logit_bias={"42": -100, "7": 5}, extra_body={"min_p": 0.05, "repetition_penalty": 1.1},
    )
    sp = seen[-1].to_sampling_params(100)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.repetition_penalty) == (1.5, -0.5, 0.05, 1.1)
    assert sp.logit_bias == ((7, 5.0), (42, -100.0))


def test_official_client_streaming(client_and_seen):
    client, _ = client_and_seen
    chunks = list(
        client.chat.completions.create(
            model="prism-tiny",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=0,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi there"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


def test_official_client_sees_400_with_param(client_and_seen):
    client, _ = client_and_seen
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], top_p=1.5)
    assert info.value.param == "top_p" and "top_p" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], presence_penalty=2.5
        )
    assert info.value.param == "presence_penalty"


def test_request_model_is_importable_for_fastapi_bodies():
    # The server may declare ChatCompletionRequest as a FastAPI body; its JSON schema must build.
    schema = ChatCompletionRequest.model_json_schema()
    assert "messages" in schema["properties"] and schema["additionalProperties"] is False
