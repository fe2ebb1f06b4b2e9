"""Found by users coming from vLLM: Qwen3-VL's model card recommends `presence_penalty=1.5` for its
Instruct models, and the server refused any non-zero penalty (and any logit_bias) with a 400, "penalties are not
implemented by this server". Fixed: the penalties, logit_bias, min_p and repetition_penalty are implemented
(`engine/penalties.py`, `engine/sampler.py`).

The model card's request must be accepted, and change nothing it should not: with greedy decoding the penalized
answer is the plain one's token for token up to the plain one's first repeated token (a presence penalty lowers only
tokens already output), with the same logprobs (reported from the raw logits, not the penalized ones)."""

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
CARD = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.0, "presence_penalty": 1.5}

server = serve_in_thread(ServerSettings())
try:
    def post(**fields) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", timeout=120,
                          json={"model": "prism-tiny", "messages": MESSAGES, **fields})

    card = post(max_tokens=16, **CARD)
    if card.status_code != 200:
        _common.verdict(False, "", f"the model card's request got {card.status_code}: {card.text}")

    def greedy(presence: float) -> list[tuple[str, float]]:
        body = post(max_tokens=24, temperature=0, presence_penalty=presence, logprobs=True, ignore_eos=True).json()
        return [(t["token"], t["logprob"]) for t in body["choices"][0]["logprobs"]["content"]]

    plain, penalized = greedy(0.0), greedy(1.5)
finally:
    server.stop()

first_repeat = next((k for k, (token, _) in enumerate(plain) if token in {t for t, _ in plain[:k]}), len(plain))
same = all(a[0] == b[0] and abs(a[1] - b[1]) <= 1e-4 for a, b in zip(plain[:first_repeat], penalized[:first_repeat],
                                                                      strict=True))
changed = [t for t, _ in penalized] != [t for t, _ in plain]
_common.verdict(
    same and changed,
    f"the model card's request is accepted; greedy with presence_penalty=1.5 keeps the plain answer's first "
    f"{first_repeat} tokens and their logprobs, then avoids the repeat",
    f"accepted, but the penalized greedy answer {penalized[:first_repeat + 1]} is not the plain one "
    f"{plain[:first_repeat + 1]} up to its first repeat (or the penalty changed nothing: {not changed})",
)
