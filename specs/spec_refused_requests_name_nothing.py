"""Spec of image uuids across refused requests (`InputProcessor.bind_names`, called by the engine when it accepts a
prompt): a request the engine refuses names nothing.

Invariant: over any sequence of chat requests whose images are sent with uuids (two names over three pictures),
some refused (a prompt past max_model_len, or a uuid already naming another picture, in the registry or earlier in
the same prompt), a uuid names a picture exactly when an accepted request sent it with that uuid, and it names the
first such picture. (Session 27's review: a request refused for its max_tokens, or for a conflict between two of its
own parts, had bound its uuids anyway, and later clients sending other pictures under them were refused.)
"""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine.chat import InputError
from prism.engine.engine import RequestError
from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

PICTURES = random_images([(32, 32), (64, 32), (32, 64)], seed=11)
MAX_MODEL_LEN = 400


@functools.lru_cache(maxsize=1)
def pictures_digests() -> list[bytes]:
    proc = LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=8).engine.inputs
    return [proc.prepare_chat([{"role": "user", "content": [{"type": "image", "image": p}]}], bind_names=False)
            .media[0].digest for p in PICTURES]


requests = st.lists(st.tuples(
    st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["x", "y"])), min_size=1, max_size=2),  # (picture, uuid)
    st.booleans(),  # a prompt too long for the context
), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(sent=requests)
def spec_a_refused_request_names_nothing(sent) -> None:
    llm = LLM(ensure_tiny_checkpoint(), dtype="float32", page_size=16, num_gpu_pages=64, max_model_len=MAX_MODEL_LEN)
    engine, digests = llm.engine, pictures_digests()
    named: dict[str, int] = {}  # what accepted requests told the server
    for parts, too_long in sent:
        text = "word " * (MAX_MODEL_LEN if too_long else 2)
        content = [{"type": "image", "image": PICTURES[p], "uuid": u} for p, u in parts] + [{"type": "text", "text": text}]
        conflict = any(named.get(u, p) != p for p, u in parts) or any(
            p != q and u == v for p, u in parts for q, v in parts)
        try:
            engine.add_request(f"r{len(engine.requests)}-{id(parts)}", [{"role": "user", "content": content}],
                               SamplingParams(max_tokens=1))
            accepted = True
        except (InputError, RequestError):
            accepted = False
        assert accepted == (not too_long and not conflict), f"request {parts} (too long: {too_long}) accepted: {accepted}"
        if accepted:
            for p, u in parts:
                named.setdefault(u, p)
        for uuid in ("x", "y"):
            found = engine.inputs.image_names.resolve(uuid)
            want = named.get(uuid)
            assert (found is None) == (want is None), f"uuid {uuid!r} is bound: {found is not None}, by accepted requests: {want}"
            if want is not None:
                assert found[1] == digests[want], f"uuid {uuid!r} names another picture than the first accepted one"
    while engine.has_unfinished_requests():
        engine.step()
