"""Spec of decoding a client's image bytes (`media.image.decode_image`): which bytes become pixels, and which pixels,
and how many pixels a request's images may decode to (`media.pixel_budget`).

- Decoding never starts a process. Pillow's EPS decoder runs Ghostscript on the bytes; here Pillow is told that
  Ghostscript is installed and `subprocess.Popen` records (and refuses) whatever would start.
- Bytes in a format outside `ACCEPTED_FORMATS` are refused as `MediaDecodeError`, whatever Pillow could open.
- Bytes in an accepted format decode to the pixels HF's `load_image` makes of them (EXIF orientation, then RGB), and
  the formats clients send most (PNG, JPEG, WebP, GIF, BMP, TIFF) always decode.
- Every accepted format is opened from its header alone: no pixel is decoded until the size limits have judged the
  image (`Image.open` of Pillow's ICO decodes the whole picture, so ICO is not accepted; the review of session 33).
- A request's images are accepted exactly when the pixels their headers announce sum to at most `max_image_pixels`
  (an image named by its uuid alone counts none), by the server's media resolver and by the engine's input
  processor alike; a refused one is a 413 (`MediaTooLarge`) / `ImagePixelBudgetError` naming the limit and its total,
  and leaves nothing behind: no image decoded, nothing in the decoded-URL or preprocessing cache, no uuid bound. (The
  media hunt of session 30: only video frames had a budget; a request's images, each up to ~89 M pixels, had none.)
- A prompt's videos are accepted by the engine exactly when the frames they sample (as HF's `sample_frames` samples
  them; a frame sampled twice counts twice), width x height each, sum to at most `max_video_pixels`, whatever form
  the frames come in (encoded bytes, arrays, PIL images); a refused one is a `VideoPixelBudgetError` (an
  `ImagePixelBudgetError`: a 413) naming the limit and its total, with nothing decoded (no frame, and no image the
  prompt sends beside its videos) and nothing cached. An accepted one decodes each sampled frame given as bytes once,
  and no other. (The review of session 35: offline, video frames had no budget at all, and every sampled frame was
  decoded twice, for the cache key and again for the pixels. Session 34's review of that fix: the budget was judged
  only after the prompt's images were decoded, cached and, in the engine, encoded on the device.)
- The server refuses a video frame that announces more pixels than one frame may have (`DecodeLimits.max_pixels`,
  89,478,485) or than the request's `max_video_pixels` has left, a 413 naming the limit it crossed: a frame alone past
  its own limit is never blamed on `max_video_pixels`. (Session 34's review: a 90 M pixel frame of a request within
  its 2**27 budget was refused as exceeding `max_video_pixels=134217728`.)
- The server's resolver refuses at the lower of its own and the engine config's pixel limits; its 413 names the
  limit it applied, and says so when that is the engine config's, below the server's `PRISM_MAX_*_PIXELS`. (Session
  34's review: with the engine's new video budget, a server whose operator had raised `PRISM_MAX_VIDEO_PIXELS` refused
  at the engine's default 2**27, its message naming neither where that came from nor the variable.)
- The engine a server builds takes the server's pixel budgets (`PRISM_MAX_IMAGE_PIXELS`, `PRISM_MAX_VIDEO_PIXELS`)
  wherever its `PRISM_CONFIG` file names none, so that raising a variable raises the limit; a budget the file names
  stays the file's. (Session 34: the engine took the file's or its defaults only, so raising `PRISM_MAX_IMAGE_PIXELS`
  past 2**28 for albums of large photos, as the README advised, changed nothing: the engine refused at 2**28.)
"""

from __future__ import annotations

import base64
import functools
import io
import itertools
import struct
import subprocess
import types
import warnings
import zlib
from unittest import mock

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import EpsImagePlugin, Image
from transformers.image_utils import load_image
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from prism.engine.config import EngineConfig
from prism.engine.inputs import InputProcessor
from prism.media import image as media_image
from prism.media.errors import ImagePixelBudgetError, MediaDecodeError, VideoPixelBudgetError
from prism.media.image import ACCEPTED_FORMATS, decode_image
from prism.serving.media_urls import MediaResolver, MediaTooLarge
from prism.serving.protocol import parse_chat_request
from prism.serving.settings import ServerSettings
from prism.testing.checkpoints import ensure_tiny_checkpoint

Image.init()
# Every format this Pillow writes: the accepted ones and the ones a client could send all the same.
WRITTEN = sorted(Image.SAVE)
COMMON = {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"}
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\nshowpage\n"


def _encoded(arr: np.ndarray, mode: str, fmt: str) -> bytes | None:
    """The picture written in `fmt` (None where Pillow cannot write this mode in it)."""
    img = Image.fromarray(arr)
    img = img if mode == "RGB" else img.convert(mode)
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():  # Pillow's deprecation notices of the formats it will drop
            warnings.simplefilter("ignore", DeprecationWarning)
            img.save(buf, format=fmt)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return buf.getvalue()


def _pillow_format(data: bytes) -> str | None:
    """The format Pillow (unrestricted, opening only the header) reads the bytes as."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with Image.open(io.BytesIO(data)) as img:
                return img.format
    except Exception:  # noqa: BLE001 - bytes Pillow cannot open at all
        return None


@settings(max_examples=120, deadline=None)
@given(
    h=st.integers(1, 20), w=st.integers(1, 20), seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(["RGB", "RGBA", "L", "P"]), fmt=st.sampled_from(WRITTEN),
)
@example(h=8, w=8, seed=0, mode="RGB", fmt="EPS")
def spec_decoding_runs_no_program_and_decodes_as_hf(h, w, seed, mode, fmt) -> None:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    data = EPS if fmt == "EPS" else _encoded(arr, mode, fmt)
    if data is None:
        return
    started: list = []

    def record(args, *a, **k):
        started.append(args)
        raise OSError("no process may start while an image is decoded")

    with mock.patch.object(EpsImagePlugin, "gs_binary", "gs"), mock.patch.object(subprocess, "Popen", record):
        try:
            decoded = decode_image(data)
        except MediaDecodeError:
            decoded = None
    assert not started, f"decoding {fmt} bytes started {started}"
    opened_as = _pillow_format(data)
    if opened_as is not None and opened_as not in ACCEPTED_FORMATS and opened_as != "MPO":
        assert decoded is None, f"{opened_as} bytes (written as {fmt}) were decoded; accepted: {ACCEPTED_FORMATS}"
        return
    if fmt in COMMON:
        assert decoded is not None, f"{fmt} bytes of a {mode} picture were refused"
    if decoded is not None:
        expected = np.asarray(load_image(Image.open(io.BytesIO(data))))
        assert np.array_equal(np.asarray(decoded), expected), f"{fmt} bytes decode to other pixels than HF's"


BUDGET = 48 * 48  # max_image_pixels here: a handful of small images cross it, or not
KNOWN = "known-48x48"  # a uuid naming a 48 x 48 image: counted, it alone would fill the budget
_requests = itertools.count()


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 40), w=st.integers(1, 40), seed=st.integers(0, 2**16), data=st.data())
def spec_every_accepted_format_opens_from_its_header(h, w, seed, data) -> None:
    fmt = data.draw(st.sampled_from(media_image.decoded_formats()), label="format")  # (looked up at each example)
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    encoded = _encoded(arr, "RGB", fmt)
    if encoded is None:  # this Pillow cannot write it
        return
    with media_image._opened(encoded, media_image.DEFAULT_LIMITS) as opened:  # what the size limits judge
        assert opened.size == (w, h), f"{fmt}: opened as {opened.size}, written {(w, h)}"
        assert opened._im is None, f"{fmt}: opening it decoded its pixels (before any size limit saw them)"


def _png(width: int, height: int, colour: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (colour, 255 - colour, colour // 2)).save(buf, format="PNG")
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def _engine_inputs() -> InputProcessor:
    """The engine's input processor under the budget, with a preprocessing cache, KNOWN sent once."""
    proc = InputProcessor(ensure_tiny_checkpoint(), model_id="spec-pixel-budget", cache_bytes=2**26,
                          max_image_pixels=BUDGET)
    proc.prepare_chat([{"role": "user", "content": [{"type": "image", "image": _png(48, 48, 7), "uuid": KNOWN}]}])
    return proc


def _prepared_recording_decodes(proc: InputProcessor, chat: list[dict]):
    """`proc.prepare_chat(chat)` recording what it decodes: (its prompt or None, its `ImagePixelBudgetError` or None,
    the encoded images it decoded, its preprocessing cache's (entries, bytes) before)."""
    decoded: list[bytes] = []
    decode = media_image.decode_image

    def recorded(data, limits=media_image.DEFAULT_LIMITS):
        decoded.append(data)
        return decode(data, limits)

    cached = len(proc.cache), proc.cache.stats().bytes
    with mock.patch.object(media_image, "decode_image", recorded):
        try:
            return proc.prepare_chat(chat), None, decoded, cached
        except ImagePixelBudgetError as error:
            return None, error, decoded, cached


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 48), st.integers(1, 48), st.integers(0, 255)), min_size=1, max_size=5),
       named=st.integers(0, 5))
@example(sizes=[(48, 48, 1)], named=0)  # exactly the budget
@example(sizes=[(48, 48, 1), (1, 1, 2)], named=0)  # one pixel past it
@example(sizes=[(24, 48, 3), (24, 48, 4)], named=1)  # the budget, and a uuid naming as many pixels again
def spec_a_requests_images_are_accepted_iff_their_pixels_fit_the_budget(sizes, named) -> None:
    pngs = [_png(w, h, colour) for w, h, colour in sizes]
    total = sum(w * h for w, h, _ in sizes)
    fits = total <= BUDGET
    request = next(_requests)
    parts = [{"type": "image", "image": data, "uuid": f"r{request}-{i}"} for i, data in enumerate(pngs)]
    parts.insert(min(named, len(parts)), {"type": "image", "image": None, "uuid": KNOWN})  # where the uuid goes
    chat = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]

    # The server: its media resolver, on the same pictures as data URLs.
    resolver = MediaResolver(ServerSettings(max_image_pixels=BUDGET))
    http_parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
                  for data in pngs]
    http_parts.insert(min(named, len(http_parts)), {"type": "image_url", "image_url": None, "uuid": KNOWN})
    messages = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": http_parts}]}).messages
    try:
        resolver.resolve_messages(messages)
        refused = None
    except MediaTooLarge as error:
        refused = error
    assert (refused is None) == fits, f"the server {'refused' if refused else 'accepted'} images of {total} pixels " \
                                      f"in all, max_image_pixels={BUDGET}: {refused}"
    if refused is not None:
        assert refused.status == 413 and f"{total} pixels in all" in refused.message, refused.message
        assert f"max_image_pixels={BUDGET}" in refused.message, refused.message
        assert resolver._decoded.nbytes == 0, "a refused request's data URLs were cached"

    # The engine: its input processor.
    proc = _engine_inputs()
    prompt, refused, decoded, cached = _prepared_recording_decodes(proc, chat)
    assert (refused is None) == fits, f"the engine {'refused' if refused else 'accepted'} images of {total} pixels " \
                                      f"in all, max_image_pixels={BUDGET}: {refused}"
    if refused is None:
        assert len(prompt.media) == len(pngs) + 1
        return
    assert (refused.total, refused.limit) == (total, BUDGET), (refused.total, refused.limit)
    assert not decoded, f"{len(decoded)} image(s) of a refused request were decoded"
    assert (len(proc.cache), proc.cache.stats().bytes) == cached, "a refused request left images in the cache"
    bound = [i for i in range(len(pngs)) if proc.image_names.resolve(f"r{request}-{i}") is not None]
    assert not bound, f"a refused request bound the uuids of its images {bound}"


VIDEO_BUDGET = 6 * 32 * 32  # max_video_pixels here: a video or two of a few small frames cross it, or not


@functools.lru_cache(maxsize=1)
def _video_inputs() -> InputProcessor:
    return InputProcessor(ensure_tiny_checkpoint(), model_id="spec-video-budget", cache_bytes=2**26,
                          max_video_pixels=VIDEO_BUDGET)


def _hf_sampled(total: int, fps: float, num_frames: int | None) -> list[int]:
    cfg = _video_inputs().video_config
    stub = types.SimpleNamespace(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    meta = VideoMetadata(total_num_frames=total, fps=fps)
    return np.asarray(Qwen3VLVideoProcessor.sample_frames(stub, meta, num_frames=num_frames)).tolist()


_video = st.tuples(
    st.integers(2, 8),  # frames given
    st.integers(8, 40), st.integers(8, 40),  # their width and height
    st.sampled_from(["png", "array", "pil"]),
    st.sampled_from([0.5, 2.0, 30.0]),  # their frame rate
    st.one_of(st.none(), st.integers(2, 12)),  # num_frames (past the frames given: some sampled twice)
)


_PICTURES = itertools.count()  # each example's image is new to the shared cache: preparing it decodes it


@settings(max_examples=40, deadline=None)
@given(videos=st.lists(_video, min_size=1, max_size=2), seed=st.integers(0, 2**16), with_image=st.booleans())
@example(videos=[(6, 32, 32, "png", 2.0, 6)], seed=0, with_image=False)  # exactly the budget
@example(videos=[(6, 32, 32, "png", 2.0, 6), (2, 8, 8, "array", 2.0, None)], seed=0,
         with_image=False)  # past it by a second video
@example(videos=[(2, 32, 32, "png", 2.0, 5)], seed=0, with_image=False)  # 2 frames sampled 5 times: 2 decodes
@example(videos=[(8, 32, 32, "array", 30.0, 7)], seed=0, with_image=True)  # past it, an image before the video
def spec_a_prompts_video_frames_are_accepted_iff_their_sampled_pixels_fit_the_budget(videos, seed, with_image) -> None:
    rng = np.random.default_rng(seed)
    picture = _png_of(np.random.default_rng([1, next(_PICTURES)]).integers(0, 256, (16, 16, 3), dtype=np.uint8)
                      ) if with_image else None
    parts = [{"type": "image", "image": picture}] if with_image else []
    given, total = [], 0
    for count, w, h, form, fps, num_frames in videos:
        arrays = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(count)]
        frames = ([_png_of(a) for a in arrays] if form == "png" else
                  [Image.fromarray(a) for a in arrays] if form == "pil" else arrays)
        sampled = _hf_sampled(count, fps, num_frames)
        total += len(sampled) * w * h
        given.append((frames, sampled))
        parts.append({"type": "video", "video": frames, "fps": fps}
                     | ({"num_frames": num_frames} if num_frames is not None else {}))
    chat = [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]
    proc = _video_inputs()
    prompt, refused, decoded, cached = _prepared_recording_decodes(proc, chat)
    fits = total <= VIDEO_BUDGET
    assert (refused is None) == fits, f"the engine {'refused' if refused else 'accepted'} video frames of {total} " \
                                      f"pixels in all, max_video_pixels={VIDEO_BUDGET}: {refused}"
    if refused is not None:
        assert isinstance(refused, VideoPixelBudgetError), type(refused)
        assert (refused.total, refused.limit) == (total, VIDEO_BUDGET), (refused.total, refused.limit)
        assert f"max_video_pixels={VIDEO_BUDGET}" in str(refused), str(refused)
        assert not decoded, f"a refused prompt decoded {len(decoded)} of its frames or images"
        assert (len(proc.cache), proc.cache.stats().bytes) == cached, "a refused prompt left media in the cache"
        return
    assert [m.kind for m in prompt.media] == ["image"] * with_image + ["video"] * len(videos)
    want = sorted([id(frames[i]) for frames, sampled in given for i in set(sampled) if isinstance(frames[i], bytes)]
                  + ([id(picture)] if with_image else []))
    assert sorted(map(id, decoded)) == want, \
        f"decoded {len(decoded)} frames for {len(want)} sampled ones given as bytes (each is decoded once)"


def _png_of(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


FRAME_LIMIT = media_image.DEFAULT_LIMITS.max_pixels


def _announcing_png(width: int, height: int) -> bytes:
    """A greyscale PNG whose header announces width x height and whose pixels are cut short: judged by its header
    alone (decoding it fails at once)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(16))) + chunk(b"IEND", b""))


def _frame_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@settings(max_examples=30, deadline=None)
@given(height=st.integers(9000, 9700), budget=st.integers(80_000_000, 200_000_000))
@example(height=9419, budget=2**27)  # 9500 x 9419 = 89,480,500: past a frame's limit, within the default budget
@example(height=9418, budget=2**27)  # 89,471,000: within both
@example(height=9419, budget=89_480_000)  # past both
@example(height=9418, budget=89_470_000)  # within a frame's limit, past the budget left
def spec_a_video_frame_refused_names_the_limit_it_crossed(height, budget) -> None:
    small = _png_of(np.zeros((4, 4, 3), np.uint8))  # 16 pixels of the budget taken first
    announced, left = 9500 * height, budget - 16
    part = {"type": "video", "video": {"frames": [_frame_url(small), _frame_url(_announcing_png(9500, height))],
                                       "fps": 2.0}}
    messages = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [part]}]}).messages
    try:
        with warnings.catch_warnings():  # Pillow's own notice of a header past its bomb limit
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            MediaResolver(ServerSettings(max_video_pixels=budget)).resolve_messages(messages)
        refused = None  # (the server decodes no frame: the engine finds this one's pixels cut short)
    except MediaTooLarge as error:
        refused = error
    if refused is None:
        assert announced <= min(FRAME_LIMIT, left), f"a frame of {announced} pixels ({left} left) was accepted"
        return
    assert announced > min(FRAME_LIMIT, left), f"a frame of {announced} pixels refused, {left} left: {refused}"
    assert refused.status == 413 and refused.param.endswith("video.frames[1]"), (refused.status, refused.param)
    names_budget, names_frame_limit = f"max_video_pixels={budget}" in refused.message, str(FRAME_LIMIT) in refused.message
    if announced <= FRAME_LIMIT:
        assert names_budget, f"a frame of {announced} pixels, past the {left} left, refused as: {refused.message}"
    elif announced <= left:
        assert names_frame_limit and "max_video_pixels" not in refused.message, \
            f"a frame of {announced} pixels, within the {left} its request has left, refused as: {refused.message}"
    else:  # past both: either is the truth
        assert names_budget or names_frame_limit, refused.message


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["image", "video"]), own=st.integers(64, 256), engines=st.integers(64, 256))
@example(kind="video", own=2**30, engines=128)  # the variable raised, the engine config's default left
@example(kind="image", own=128, engines=2**30)
def spec_a_servers_pixel_refusal_says_whose_limit_it_is(kind, own, engines) -> None:
    name, pictures = f"max_{kind}_pixels", [_png(8, 8, 40 * i) for i in range(3)]  # 192 pixels in all
    urls = ["data:image/png;base64," + base64.b64encode(p).decode() for p in pictures]
    parts = ([{"type": "image_url", "image_url": {"url": u}} for u in urls] if kind == "image"
             else [{"type": "video", "video": {"frames": urls, "fps": 2.0}}])
    messages = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": parts}]}).messages
    resolver = MediaResolver(ServerSettings(**{name: own}), **{name: min(own, engines)})  # as `ServerState` makes it
    try:
        resolver.resolve_messages(messages)
        refused = None
    except MediaTooLarge as error:
        refused = error
    limit = min(own, engines)
    assert (refused is None) == (192 <= limit), f"192 {kind} pixels, {name}={own}, the engine's {engines}: {refused}"
    if refused is None:
        return
    assert f"{name}={limit}" in refused.message, refused.message
    says_engine = "engine config" in refused.message and f"PRISM_{name.upper()}={own}" in refused.message
    assert says_engine == (engines < own), \
        f"the server's {own}, the engine's {engines}: {refused.message}"


@settings(max_examples=30, deadline=None)
@given(own=st.fixed_dictionaries({"max_image_pixels": st.integers(1, 2**40), "max_video_pixels": st.integers(1, 2**40)}),
       named=st.dictionaries(st.sampled_from(["max_image_pixels", "max_video_pixels"]), st.integers(1, 2**40)),
       other=st.booleans())
def spec_the_engine_a_server_builds_takes_the_servers_pixel_budgets(own, named, other) -> None:
    import json
    import tempfile

    from prism.serving import server_state

    in_file = {**named, **({"page_size": 8} if other else {})}
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if in_file:
            path = f"{tmp}/engine.json"
            with open(path, "w") as f:
                json.dump(in_file, f)
        config = server_state.engine_config_of(ServerSettings(engine_config_path=path, **own))
    for name in ("max_image_pixels", "max_video_pixels"):
        want = named.get(name, own[name])
        assert getattr(config, name) == want, f"{name}: the server's {own[name]}, the file's {named.get(name)}: " \
                                              f"the engine's {getattr(config, name)}"
    assert config.page_size == (8 if other else EngineConfig().page_size)
