"""Found by review (session 28): a 57 MB string prompt to /v1/completions froze the server for ~112 s and took 6 GB
before its 400: the whole string was tokenized first, by `Tokenizer.encode`, which holds the GIL (the event loop and
the engine thread stood still with it). Now a text longer than the limit's tokens could cover is refused before
tokenizing (`InputProcessor.max_prompt_chars`), and tokenizing goes through `encode_batch`, which lets other threads
run. Checked here: a 60 MB prompt is refused within a second, and another thread keeps ticking while 3.6 MB of text
is tokenized."""

from __future__ import annotations

import threading
import time

import _common  # noqa: F401 - makes `prism` importable

from prism.engine.inputs import InputProcessor, PromptTooLongError
from prism.testing.checkpoints import ensure_tiny_checkpoint

inputs = InputProcessor(ensure_tiny_checkpoint(), max_text_tokens=32767)
start = time.perf_counter()
try:
    inputs.prepare_prompt("hello world " * 5_000_000)
    refused_s = None
except PromptTooLongError:
    refused_s = time.perf_counter() - start

ticks: list[float] = []
stop = threading.Event()


def tick() -> None:
    while not stop.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.001)


ticker = threading.Thread(target=tick)
ticker.start()
time.sleep(0.05)
start = time.perf_counter()
inputs.encode("hello world " * 300_000)
end = time.perf_counter()
stop.set()
ticker.join()
gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False) if b >= start]
longest = max(gaps, default=end - start)
_common.verdict(
    refused_s is not None and refused_s < 1.0 and longest < 0.5,
    f"a 60 MB prompt refused in {refused_s:.3f} s; while 3.6 MB were tokenized ({end - start:.2f} s) another "
    f"thread waited at most {longest * 1e3:.0f} ms",
    f"a 60 MB prompt {'was not refused' if refused_s is None else f'took {refused_s:.1f} s to refuse'}, and "
    f"tokenizing 3.6 MB held another thread for {longest:.2f} s",
)
