"""Spec of the server's refusals of a chat request's videos (`serving.video_frames`, `serving.media_urls`): whatever
can be known without decoding a frame is refused before any frame is decoded, and the server and the engine agree.

For any request of videos given as frames (PNG data URLs) at any frame rate the protocol takes (any positive float,
subnormal and huge ones included), under a `max_video_pixels`:
- the server refuses a video the engine refuses for its sampling (its frame count and rate: timestamps past what a
  float tells apart, frame counts past the floats, fewer sampled frames than a temporal patch) as a 400 carrying the
  engine's reason, and accepts every video the engine takes (the engine's own pixel budget out of the way: it is the
  image-decoding spec's);
- otherwise the server refuses the request exactly when the frames its videos sample (as HF's `sample_frames` samples
  them) announce more than `max_video_pixels` (a 413 naming the limit and saying that it counts the sampled frames),
  as the engine counts them;
- the server decodes no frame: a request it refuses leaves nothing in the decoded-URL cache; one it accepts, the
  engine prepares, decoding each frame its videos sample once and no other; a video the engine refuses for its
  sampling, the engine decodes none of.

(Found in session 36: the server decoded all of a request's frames, then the engine refused its fps: 64 frames of
640 x 480 at fps=1e-300 were decoded, and their data URLs cached, for a 400; a request's frames past its pixel
budget were decoded up to the frame that crossed it; a one-frame video was decoded by the server and again by the
engine before its refusal. Session 37: the server decoded every frame of a video it accepted, the engine then using
only the sampled ones, 17 of a 30 fps video's 256.)
"""

from __future__ import annotations

import base64
import functools
import io
import itertools
import types
from contextlib import contextmanager

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from prism.engine.inputs import InputProcessor
from prism.media.errors import VideoError
from prism.serving.media_urls import MediaResolver, MediaURLError
from prism.serving.protocol import parse_chat_request
from prism.serving.settings import ServerSettings
from prism.testing.checkpoints import ensure_tiny_checkpoint

BUDGET = 5 * 24 * 24  # the server's max_video_pixels here: a video or two of a few small frames cross it, or not


@functools.lru_cache(maxsize=1)
def _engine_inputs() -> InputProcessor:
    """The engine's input processor, its video budget out of the way: it refuses a video only for its sampling."""
    return InputProcessor(ensure_tiny_checkpoint(), model_id="spec-server-videos", max_video_pixels=2**40)


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@contextmanager
def recording_decodes():
    """The sizes of the encoded images decoded meanwhile, by whoever decodes them (each load of an opened image's
    pixels, which reading its header does not do; Pillow asks for a load again once it has them: not counted)."""
    decoded: list[tuple[int, int]] = []
    load = ImageFile.ImageFile.load

    def recorded(self):
        if self.tile:  # pixels not loaded yet
            decoded.append(self.size)
        return load(self)

    ImageFile.ImageFile.load = recorded
    try:
        yield decoded
    finally:
        ImageFile.ImageFile.load = load


def hf_sampled(total: int, video_fps: float, proc: InputProcessor) -> list[int]:
    """The frames HF's `Qwen3VLVideoProcessor.sample_frames` samples of `total` at `video_fps` under `proc`'s video
    processor settings."""
    cfg = proc.video_config
    stub = types.SimpleNamespace(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    meta = VideoMetadata(total_num_frames=total, fps=video_fps)
    return np.asarray(Qwen3VLVideoProcessor.sample_frames(stub, meta)).tolist()


def _engines_verdict(proc: InputProcessor, videos: list[tuple[list[bytes], float]]) -> tuple[VideoError | None, int]:
    """The engine's `VideoError` for these videos given as their bytes (None: it takes them), and how many frames it
    decoded."""
    chat = [{"role": "user", "content": [*({"type": "video", "video": frames, "fps": fps} for frames, fps in videos),
                                         {"type": "text", "text": "What happens?"}]}]
    with recording_decodes() as decoded:
        try:
            proc.prepare_chat(chat)
            return None, len(decoded)
        except VideoError as error:
            return error, len(decoded)


_requests = itertools.count()
_rates = st.one_of(
    st.sampled_from([5e-324, 1e-300, 2.0**-50, 1e-12, 0.5, 2.0, 30.0, 1e300]),
    st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, allow_nan=False),
)
_video = st.tuples(st.integers(1, 6), st.integers(8, 24), st.integers(8, 24), _rates)  # frames, width, height, fps


@settings(max_examples=40, deadline=None)
@given(videos=st.lists(_video, min_size=1, max_size=2))
@example(videos=[(4, 16, 16, 1e-300)])  # timestamps past 2**49 s
@example(videos=[(4, 16, 16, 5e-324)])  # a frame count past the floats
@example(videos=[(1, 16, 16, 2.0)])  # one frame: fewer than a temporal patch
@example(videos=[(4, 24, 24, 2.0), (2, 24, 24, 1e-300)])  # the second video refused: the first's frames not decoded
@example(videos=[(5, 24, 24, 2.0)])  # exactly the budget
@example(videos=[(5, 24, 24, 2.0), (2, 8, 8, 2.0)])  # past it by the second video's last frame
@example(videos=[(6, 24, 24, 30.0)])  # the 6 frames sent past it, the 4 sampled within it
def spec_a_servers_video_refusals_come_before_any_frame_is_decoded(videos) -> None:
    rng = np.random.default_rng(next(_requests))
    given_frames = [([_png(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(count)], fps)
                    for count, w, h, fps in videos]
    proc = _engine_inputs()
    engine_refused, engine_decoded = _engines_verdict(proc, given_frames)
    if engine_refused is not None:
        assert engine_decoded == 0, f"the engine decoded {engine_decoded} frames of videos it refused ({engine_refused})"

    parts = [{"type": "video", "video": {"frames": ["data:image/png;base64," + base64.b64encode(p).decode()
                                                    for p in frames], "fps": fps}} for frames, fps in given_frames]
    messages = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": parts}]}).messages
    resolver = MediaResolver(ServerSettings(max_video_pixels=BUDGET), video_config=proc.video_config)
    with recording_decodes() as decoded:
        try:
            resolved, refused = resolver.resolve_messages(messages), None
        except MediaURLError as error:
            resolved, refused = None, error
    shown = [(count, f"{w}x{h}", fps) for count, w, h, fps in videos]
    assert not decoded, f"the server decoded {len(decoded)} frames of videos {shown} ({refused or 'accepted'})"
    if engine_refused is not None:
        assert refused is not None, f"the server accepted videos {shown} that the engine refuses: {engine_refused}"
        assert refused.status == 400 and str(engine_refused) in refused.message, \
            f"videos {shown}: the engine refuses them for {engine_refused}; the server's {refused.status}: {refused}"
        assert resolver._decoded.nbytes == 0, "a refused request's data URLs were cached"
        return
    sampled = [hf_sampled(count, fps, proc) for count, _, _, fps in videos]
    pixels = sum(len(indices) * w * h for indices, (_, w, h, _) in zip(sampled, videos, strict=True))
    if pixels > BUDGET:
        assert refused is not None, f"the server accepted videos {shown} sampling {pixels} pixels, " \
                                    f"max_video_pixels={BUDGET}"
        assert refused.status == 413 and f"the frames this request's videos sample announce {pixels} pixels in all; " \
            f"the limit is max_video_pixels={BUDGET}" in refused.message, refused.message
        assert resolver._decoded.nbytes == 0, "a refused request's data URLs were cached"
        return
    assert refused is None, f"the server refused videos {shown} sampling {pixels} pixels, which the engine takes: " \
                            f"{refused}"
    with recording_decodes() as decoded:
        prompt = proc.prepare_chat(resolved)
    assert [m.kind for m in prompt.media] == ["video"] * len(videos)
    distinct = sum(len(set(indices)) for indices in sampled)
    assert len(decoded) == distinct, f"videos {shown}: {len(decoded)} frames decoded for the {distinct} they sample " \
                                     "(each once, no other)"
