"""GPU benchmark over HTTP: the real server (uvicorn on 127.0.0.1, in this process) and the official `openai`
client, on the 8B-shaped checkpoint built by bench_engine.py. W2 over HTTP streaming (TTFT = time to the
first content chunk, same 8 images + a new question, images sent as data URLs); W7 decide over HTTP at 1
client and at 32 concurrent clients. Writes bench/results/<date>-<gpu>-http.json/.md."""

from __future__ import annotations

import asyncio
import base64
import datetime
import io
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_io import write_results  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

CKPT = Path("/tmp/prism-bench/qwen3vl-8b-random")
CONFIG = ROOT / "configs" / "tp1_fp8.json"


def data_urls(seed: int, count: int = 8, size: int = 448) -> list[str]:
    """`count` random `size` x `size` pictures (seeded) as PNG data URLs."""
    urls = []
    for image in random_images([(size, size)] * count, seed=seed):
        buf = io.BytesIO()
        image.save(buf, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def image_message(urls: list[str], text: str, uuids: list[str] | None = None, send: bool = True) -> list[dict]:
    """The 8 images as data URLs; with `uuids` each part names its image, and with send=False only the names
    travel (`"image_url": null`, vLLM's convention for an image the server holds)."""
    parts = []
    for i, u in enumerate(urls):
        part = {"type": "image_url", "image_url": {"url": u} if send else None}
        if uuids is not None:
            part["uuid"] = uuids[i]
        parts.append(part)
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def serve(ckpt: Path, config: Path | None) -> tuple[object, str]:
    settings = ServerSettings(model_dir=ckpt, engine_config_path=config, served_model_name="qwen3-vl-8b-random",
                              max_request_bytes=256 * 2**20, max_media_bytes=32 * 2**20)
    served = serve_in_thread(settings)
    return served.server, served.url


def main() -> None:
    smoke = "--smoke" in sys.argv  # a CPU dry run of the harness on the tiny checkpoint
    if smoke:
        from prism.testing.checkpoints import ensure_tiny_checkpoint

        ckpt, config = ensure_tiny_checkpoint(), None
    else:
        ckpt, config = CKPT, CONFIG
        if not (CKPT / "config.json").exists():
            build_checkpoint("8b", CKPT, device="cuda", progress=True)
    from openai import OpenAI

    server, url = serve(ckpt, config)
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
    model = "qwen3-vl-8b-random"
    gpu = "cpu-smoke" if smoke else torch.cuda.get_device_name()
    out: dict = {"gpu": gpu, "date": datetime.date.today().isoformat()}

    def stream_ttft(urls: list[str], text: str, uuids: list[str] | None = None, send: bool = True) -> float:
        start = time.perf_counter()
        # logprobs: every token yields a chunk even when its text is empty (a random model emits such tokens)
        stream = client.chat.completions.create(model=model, messages=image_message(urls, text, uuids, send),
                                                max_tokens=4, stream=True, logprobs=True,
                                                extra_body={"ignore_eos": True})
        first = None
        for chunk in stream:
            if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].logprobs):
                first = time.perf_counter() - start
        return first

    hot = data_urls(7)
    stream_ttft(data_urls(999), "warm up")
    stream_ttft(hot, "First question about these pictures.")
    w2 = [stream_ttft(hot, f"New question {i}: which picture is brightest?") for i in range(10)]
    w1 = [stream_ttft(data_urls(100 + i), "Describe every picture.") for i in range(5)]
    # The same 8 images named by uuid: sent once with their uuids, then only the names travel.
    names = [f"bench-hot-{i}" for i in range(len(hot))]
    stream_ttft(hot, "First question, naming the pictures.", names)
    w2_uuid = [stream_ttft(hot, f"Question {i} by name: which is darkest?", names, send=False) for i in range(10)]
    out["W1_http_ttft_ms_median"] = statistics.median(w1) * 1e3
    out["W2_http_ttft_ms_median"] = statistics.median(w2) * 1e3
    out["W2_http_uuid_ttft_ms_median"] = statistics.median(w2_uuid) * 1e3

    questions = [
        {"type": "choice", "text": "Which picture is the brightest?", "options": [f"picture {i + 1}" for i in range(8)]},
        {"type": "yes_no", "text": "Do all pictures show the same scene?"},
        {"type": "score", "text": "How sharp are the pictures overall?", "levels": [1, 2, 3, 4, 5]},
    ]

    def decide_body(urls: list[str]) -> dict:
        return {"model": model, "material": image_message(urls, "Here are eight pictures."), "questions": questions}

    with httpx.Client(base_url=url, timeout=120) as http:
        http.post("/v1/decide", json=decide_body(hot)).raise_for_status()
        one = []
        for _ in range(5):
            start = time.perf_counter()
            http.post("/v1/decide", json=decide_body(hot)).raise_for_status()
            one.append(time.perf_counter() - start)
    out["W7_http_decide_1_client_hot_ms_median"] = statistics.median(one) * 1e3

    materials = [data_urls(300 + k) for k in range(4)]

    async def clients(n: int) -> float:
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=n)) as http:
            start = time.perf_counter()
            responses = await asyncio.gather(*(http.post("/v1/decide", json=decide_body(materials[i % 4]))
                                               for i in range(n)))
            elapsed = time.perf_counter() - start
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:1]
        return n / elapsed

    out["W7_http_decide_32_clients_per_s"] = asyncio.run(clients(32))
    server.should_exit = True

    md = "\n".join([
        f"HTTP (uvicorn + openai client on 127.0.0.1), {out['gpu']}, {out['date']}, configs/tp1_fp8.json",
        "",
        "| workload | Prism | target |",
        "|---|---:|---:|",
        f"| W1 cold 8 images, streaming TTFT median | {out['W1_http_ttft_ms_median']:.1f} ms | |",
        f"| W2 same 8 images + new question, streaming TTFT median | {out['W2_http_ttft_ms_median']:.1f} ms | <= 20 ms |",
        f"| W2 with the 8 images named by uuid (no pixels sent), streaming TTFT median | "
        f"{out['W2_http_uuid_ttft_ms_median']:.1f} ms | <= 20 ms |",
        f"| W7 decide (8 images + 3 questions), 1 client, same material | {out['W7_http_decide_1_client_hot_ms_median']:.1f} ms | |",
        f"| W7 decide, 32 concurrent clients over 4 materials | {out['W7_http_decide_32_clients_per_s']:.2f} decides/s | |",
    ]) + "\n"
    print(md)
    if smoke:
        return
    write_results(out, md, out["gpu"], out["date"], "http")


if __name__ == "__main__":
    main()
