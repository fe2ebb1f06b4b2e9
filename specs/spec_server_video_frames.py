"""Spec of the frames a server decodes for a video it accepts (`serving.video_frames`, `serving.media_urls`,
`engine.media_preparation`): only those the video samples, each once, and the prompt is the one its frames decoded
whole make.

For any video sent as frames (PNG or JPEG data URLs, any count the server takes, any size, at frame rates from a frame
every 20 s to 240 fps), alone or beside another:
- the prompt prepared from what the server's resolver hands the engine is the prompt prepared from every frame sent
  decoded beforehand: the same token ids (the `<t seconds>` timestamps' text among them), text, M-RoPE positions,
  token types, and for each video the same pixel values, grid, timestamps, pad runs and digests;
- the frames decoded, by the server and the engine together, are exactly the frames the video samples (HF's
  `Qwen3VLVideoProcessor.sample_frames` under the checkpoint's video processor settings), each once.

(Session 37: the server decoded every frame sent and the engine sampled them again, using 4 of a 30 fps video's 64
frames, 17 of its 256: the server decoded 16 and 15 times the frames needed.)
"""

from __future__ import annotations

import base64
import functools
import io

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from prism.engine.inputs import InputProcessor
from prism.engine.prompt import PreparedPrompt
from prism.media.image import decode_image
from prism.serving.media_urls import MediaResolver
from prism.serving.protocol import parse_chat_request
from prism.serving.settings import ServerSettings
from prism.testing.checkpoints import ensure_tiny_checkpoint
from specs.spec_server_video_refusals import hf_sampled, recording_decodes


@functools.lru_cache(maxsize=1)
def _engine_inputs() -> InputProcessor:
    """The engine's input processor, without a preprocessing cache: each prompt is prepared from its own frames."""
    return InputProcessor(ensure_tiny_checkpoint(), model_id="spec-server-video-frames")


def _encoded(arr: np.ndarray, form: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=form)
    return buf.getvalue()


def differences(got: PreparedPrompt, want: PreparedPrompt) -> list[str]:
    """What differs between two prepared prompts (nothing: the same prompt)."""
    found = [name for name in ("token_ids", "text", "rope_delta") if getattr(got, name) != getattr(want, name)]
    found += [name for name in ("positions", "mm_token_type_ids")
              if not torch.equal(getattr(got, name), getattr(want, name))]
    if len(got.media) != len(want.media):
        return [*found, f"{len(got.media)} media for {len(want.media)}"]
    for k, (a, b) in enumerate(zip(got.media, want.media, strict=True)):
        found += [f"media {k}'s {name}" for name in ("kind", "index", "grid_thw", "timestamps", "spans", "digest",
                                                       "span_digests") if getattr(a, name) != getattr(b, name)]
        if a.pixels.shape != b.pixels.shape or not torch.equal(a.pixels, b.pixels):
            found.append(f"media {k}'s pixels")
    return found


_rates = st.one_of(st.sampled_from([0.05, 0.5, 1.0, 2.0, 2.5, 12.0, 23.976, 24.0, 29.97, 30.0, 60.0, 120.0]),
                   st.floats(0.05, 240.0))
# frames sent (two at least: one samples fewer than a temporal patch, a refusal), width, height, rate, format
_video = st.tuples(st.integers(2, 96), st.integers(8, 48), st.integers(8, 48), _rates, st.sampled_from(["PNG", "JPEG"]))


@settings(max_examples=30, deadline=None)
@given(videos=st.lists(_video, min_size=1, max_size=2), seed=st.integers(0, 2**16))
@example(videos=[(64, 40, 30, 30.0, "PNG")], seed=0)  # the reproducer's: 4 of 64 sampled
@example(videos=[(256, 16, 12, 30.0, "JPEG")], seed=1)  # the server's most frames: 17 sampled
@example(videos=[(9, 16, 16, 0.5, "PNG"), (33, 24, 8, 29.97, "PNG")], seed=2)  # every frame sampled; 4 of 33
@example(videos=[(5, 8, 8, 2.0, "PNG")], seed=3)  # every frame sampled, an odd count: the last one padded
def spec_a_video_sent_to_the_server_is_prepared_as_its_frames_decoded_whole(videos, seed) -> None:
    rng = np.random.default_rng(seed)
    sent = [[_encoded(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), form) for _ in range(count)]
            for count, w, h, _, form in videos]
    parts = [{"type": "video", "video": {"frames": [f"data:image/{form.lower()};base64," + base64.b64encode(f).decode()
                                                    for f in frames], "fps": fps}}
             for frames, (_, _, _, fps, form) in zip(sent, videos, strict=True)]
    question = {"type": "text", "text": "What happens?"}
    messages = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [*parts, question]}]}
                                  ).messages
    proc = _engine_inputs()
    resolver = MediaResolver(ServerSettings(), video_config=proc.video_config)
    with recording_decodes() as decoded:
        served = proc.prepare_chat(resolver.resolve_messages(messages))
    whole = proc.prepare_chat([{"role": "user", "content": [
        *({"type": "video", "video": [decode_image(f) for f in frames], "fps": fps}
          for frames, (_, _, _, fps, _) in zip(sent, videos, strict=True)), question]}])
    shown = [(count, f"{w}x{h}", fps, form) for count, w, h, fps, form in videos]
    found = differences(served, whole)
    assert not found, f"videos {shown}: the prompt the server's frames make differs from their frames decoded " \
                      f"whole in {', '.join(found)}"
    sampled = [hf_sampled(count, fps, proc) for count, _, _, fps, _ in videos]
    distinct = sum(len(set(indices)) for indices in sampled)
    assert len(decoded) == distinct, f"videos {shown}: {len(decoded)} frames decoded for the {distinct} they " \
                                     "sample (each once, no other)"
