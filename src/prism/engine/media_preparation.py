"""A prompt's images and videos -> their preprocessed pixels and content digests, and their place in the prompt as
the prefix cache's content.

Owns the media identity rules:
- a media item's digest is `prism.media.digest`'s content digest (same decoded pixels + same processor
  settings + same model id <=> same digest), whatever form the image came in (file bytes, PIL, array);
- a video's pad runs (one per temporal patch) each get their own digest, the video digest framed with the
  temporal index (`video_span_digest`), so runs of one video never look alike to the prefix cache;
- an image uuid names what it was first sent with (`engine/image_names.py`), and resolves only while its pixels are
  in the preprocessing cache;
- a prompt's images announce at most `max_image_pixels` pixels in all (`media.pixel_budget`), judged before any of
  them is decoded: a prompt over it leaves nothing in the cache and binds no name. The frames its videos sample
  announce at most `max_video_pixels` in all, judged once every video's sampling is settled (`plan_videos`) and
  before any of the prompt's images or frames is decoded: a prompt refused for its videos leaves no image decoded,
  cached or encoded either. Each sampled frame is decoded once (for the cache key and the pixels alike), and a
  frame not sampled never (the server hands frames over encoded, so this is where a video's frames are decoded);
  prompts sharing one `MediaMemo` (a decision's questions) prepare each image and video object once for all.

Preprocessing goes through the shared `PreprocessCache` when one is given: file bytes are keyed by their
raw digest (the same key the HTTP path uses, `media.prepare.prepare_image`), decoded pixels by a digest of
their RGB bytes and shape, videos by their sampled frames and timing. Cached values are shared: treat
`pixel_values` as read-only. `MediaPreparer` holds no mutable state after construction but its uuid registry (which
locks); its methods may run on worker threads concurrently.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ..media.cache import CacheKey, PreprocessCache
from ..media.config import ImageProcessorConfig, VideoProcessorConfig
from ..media.digest import hash_field, hash_rgb, image_digest, new_hash, pixels_digest, video_digest
from ..media.image import DecodeLimits, checked_rgb_array, header_size, preprocess_image, to_rgb_image
from ..media.pixel_budget import (
    DEFAULT_MAX_VIDEO_PIXELS,
    check_image_pixels,
    check_video_pixels,
    sampled_frame_sizes,
)
from ..media.placeholders import ExpandedPrompt
from ..media.prepare import PreparedImage, media_namespace, prepare_image
from ..media.rates import checked_rate
from ..media.video import (
    PreprocessedVideo,
    VideoSampling,
    decode_sampled_frames,
    preprocess_sampled_frames,
    sample_video,
)
from .chat import ImageInput, InputError, VideoInput
from .image_names import ImageNameConflict, ImageNames
from .prompt import PreparedMedia

_U64 = struct.Struct("<Q")
_MEDIA_THREADS = max(1, min(8, os.cpu_count() or 1))
# The images of one prompt go to the media threads as at most this many tasks (consecutive images, prompt order): a
# worker starts ~0.2-0.4 ms after its task is queued on the H200's host, so 8 one-image tasks waited for wake-ups.
# W1's preparation (8 new images, three rounds): 8 tasks 5.9-6.3 ms, 4 tasks 4.8-5.4, 2 tasks 6.0-7.2.
_MEDIA_TASKS = min(4, _MEDIA_THREADS)
_SPAN_SCHEME = b"prism.video-span.v3"
# The media of prompts built from the same message objects (a decision's material asked several questions), each
# prepared once for all of them: an image object's id -> (the object, its PreparedImage); ("video", a frames object's
# id) -> (the object, ((frame count, rate, num_frames), its PreparedVideo)). Holding the object keeps its id unused.
MediaMemo = dict[Any, tuple[Any, Any]]
_FRAMES_SCHEME = b"prism.video-frames.v3"


def video_span_digest(video_digest_: bytes, temporal_index: int) -> bytes:
    """Digest of one temporal patch's pad run: the video digest framed with the patch index."""
    h = new_hash()
    hash_field(h, b"scheme", _SPAN_SCHEME)
    hash_field(h, b"video", video_digest_)
    hash_field(h, b"temporal_index", _U64.pack(temporal_index))
    return h.digest()


@dataclass(frozen=True)
class PreparedVideo:
    """A video preprocessed, with its content digest."""

    video: PreprocessedVideo
    digest: bytes

    @property
    def nbytes(self) -> int:
        pv = self.video.pixel_values_videos
        return pv.numel() * pv.element_size() + 256


def place_media(expanded: ExpandedPrompt, prepared_images: list[PreparedImage], prepared_videos: list[PreparedVideo]
                ) -> tuple[PreparedMedia, ...]:
    """The prompt's media in prompt order, each with its pad runs and the digest the prefix cache keys each run on."""
    runs: dict[tuple[str, int], list[tuple[int, int]]] = {}
    run_digests: dict[tuple[str, int], list[bytes]] = {}
    for s in expanded.spans:
        key = (s.kind, s.media_index)
        if s.kind == "image":
            digest = prepared_images[s.media_index].digest
        else:
            digest = video_span_digest(prepared_videos[s.media_index].digest, s.temporal_index)
        runs.setdefault(key, []).append((s.start, s.length))
        run_digests.setdefault(key, []).append(digest)
    media: list[PreparedMedia] = []
    for item in expanded.items:  # prompt order
        key = (item.kind, item.media_index)
        if item.kind == "image":
            im = prepared_images[item.media_index]
            pixels, grid, digest, stamps = im.pixels, im.grid_thw, im.digest, ()
        else:
            cv = prepared_videos[item.media_index]
            pixels, grid, digest = cv.video.pixel_values_videos, cv.video.grid_thw, cv.digest
            stamps = tuple(cv.video.timestamps)
        media.append(
            PreparedMedia(
                kind=item.kind,
                index=item.media_index,
                pixels=pixels,
                grid_thw=grid,
                digest=digest,
                spans=tuple(runs[key]),
                span_digests=tuple(run_digests[key]),
                timestamps=stamps,
            )
        )
    return tuple(media)


@dataclass(frozen=True)
class VideoPlan:
    """A prompt's video before any frame is decoded: its frames as given, the ones it samples and their timestamps,
    and the `num_frames` it asked for (part of its cache key)."""

    frames: list[Any]
    sampling: VideoSampling
    num_frames: int | None
    given: Any = None  # the frames object the prompt was given (a `MediaMemo` finds the video by it)

    def memo_key(self) -> tuple[str, int]:
        return ("video", id(self.given))

    def timing(self) -> tuple[int, float, int | None]:
        """What, beside the frames object, the video prepared from it depends on."""
        return len(self.frames), self.sampling.video_fps, self.num_frames


def _not_an_image(data: object, what: str = "image") -> InputError:
    return InputError(f"{what} must be bytes, a PIL image or a uint8 [H, W, 3] array, got {type(data).__name__}")


class MediaPreparer:
    """Prepares the images and videos of prompts for one model: `model_id` namespaces their digests and cache keys,
    `cache` (optional) is the shared preprocessing cache, `limits` bound decoding, `max_image_pixels` the pixels of a
    prompt's images in all, `max_video_pixels` those of the frames its videos sample. Holds the image uuids
    (`image_names`) and the threads a prompt's images are prepared on."""

    def __init__(self, model_id: str, image_config: ImageProcessorConfig, video_config: VideoProcessorConfig,
                 cache: PreprocessCache[Any] | None, limits: DecodeLimits, max_image_pixels: int,
                 max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS) -> None:
        self.model_id = model_id
        self.image_config = image_config
        self.video_config = video_config
        self._cache = cache
        self._limits = limits
        self.max_image_pixels = max_image_pixels
        self.max_video_pixels = max_video_pixels
        self.image_names = ImageNames()  # image uuids -> the cache keys of the images they name
        # Images of one request are prepared in parallel: hashing, PIL resizing and numpy release the GIL.
        self._media_threads = ThreadPoolExecutor(max_workers=_MEDIA_THREADS, thread_name_prefix="prism-media")
        self._image_ns = json.dumps([self.model_id, self.image_config.fingerprint(), "rgb8"])
        self._bytes_ns = media_namespace(self.model_id, self.image_config)  # prepare_image's, for encoded bytes
        self._video_ns = json.dumps([self.model_id, self.video_config.fingerprint(), "video-frames"])

    @property
    def cache(self) -> PreprocessCache[Any] | None:
        return self._cache

    def _cached(self, key: CacheKey, compute: Any) -> Any:
        if self._cache is None:
            return compute()[0]
        return self._cache.get_or_compute(key, compute)

    def images(self, images: list[ImageInput], memo: MediaMemo,
               on_image: Callable[[PreparedImage], None] | None = None
               ) -> tuple[list[PreparedImage], tuple[tuple[str, CacheKey, bytes], ...]]:
        """Each image prepared once per memo (keyed by object identity; the memo holds the object, so its id
        cannot be reused while the entry lives), new ones on the media threads (`_MEDIA_TASKS` tasks of
        consecutive images), each handed to `on_image` in prompt order once its task is done; images named by uuid
        alone come from this prompt's own sends or the uuid registry. Returns the images and the names the prompt
        binds when accepted (each checked against the registry now). Images past `max_image_pixels` in all are an
        `ImagePixelBudgetError` before any is decoded."""
        self._check_pixel_budget(images, memo)
        datas = [im.data for im in images if im.data is not None]
        todo = list({id(d): d for d in datas if id(d) not in memo or memo[id(d)][0] is not d}.values())
        tasks = min(len(todo), _MEDIA_TASKS)
        chunks = [todo[i * len(todo) // tasks : (i + 1) * len(todo) // tasks] for i in range(tasks)]
        futures = [self._media_threads.submit(self._images_of, c) for c in chunks] if tasks > 1 else []
        try:  # handed on in the prompt's order, not as they finish: what the engine does stays reproducible
            prepared_in_order = (p for f in futures for p in f.result()) if futures else map(self._image, todo)
            for data, prepared in zip(todo, prepared_in_order, strict=True):
                memo[id(data)] = (data, prepared)
                if on_image is not None:
                    on_image(prepared)
        finally:  # an image that failed fails the prompt: the ones not started yet are not prepared for nothing
            for f in futures:
                f.cancel()
        sent: dict[str, tuple[CacheKey, bytes, PreparedImage]] = {}
        for im in images:  # names first, so a part may name an image a later part of the same prompt sends
            if im.data is not None and im.uuid is not None:
                prepared = memo[id(im.data)][1]
                key = self._name_key(im.data, prepared)
                if im.uuid in sent and sent[im.uuid][1] != prepared.digest:
                    raise InputError(f"image uuid {im.uuid!r} names two different images in this prompt")
                try:
                    self.image_names.check(im.uuid, prepared.digest)
                except ImageNameConflict as error:
                    raise InputError(str(error)) from error
                sent[im.uuid] = (key, prepared.digest, prepared)
        out = [memo[id(im.data)][1] if im.data is not None
               else sent[im.uuid][2] if im.uuid in sent else self._image_by_uuid(im.uuid) for im in images]
        return out, tuple((uuid, key, digest) for uuid, (key, digest, _) in sent.items())

    def _check_pixel_budget(self, images: list[ImageInput], memo: MediaMemo) -> None:
        """Each image sent with pixels counts what it announces (`media.pixel_budget`; one this memo prepared, the
        size it was decoded at: a decide's questions do not read their material's headers again); one named by its
        uuid alone carries none."""
        sizes: list[tuple[int, int] | None] = []
        for im in images:
            entry = memo.get(id(im.data)) if im.data is not None else None
            if im.data is None:
                sizes.append(None)
            elif entry is not None and entry[0] is im.data:
                height, width = entry[1].image_size
                sizes.append((width, height))
            else:
                sizes.append(self._announced_size(im.data, "image"))
        check_image_pixels(sizes, self.max_image_pixels)

    def _announced_size(self, data: Any, what: str) -> tuple[int, int]:
        """(width, height) an image or a video frame announces (encoded bytes: their header), nothing decoded."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            return header_size(data, self._limits)
        if isinstance(data, np.ndarray):
            height, width = checked_rgb_array(data, self._limits, what).shape[:2]
            return width, height
        if isinstance(data, Image.Image):
            return data.size
        raise _not_an_image(data, what)

    def _images_of(self, datas: list[Any]) -> list[PreparedImage]:
        return [self._image(d) for d in datas]

    def _check_names_usable(self) -> None:
        if self._cache is None:
            raise InputError("image uuids need the preprocessing cache (preprocess_cache_bytes > 0)")

    def _image_by_uuid(self, uuid: str | None) -> PreparedImage:
        """The prepared image `uuid` names (`engine/image_names.py`), or InputError if the name is not held or
        its pixels were evicted (the client sends the image with its uuid again)."""
        self._check_names_usable()
        assert self._cache is not None
        found = self.image_names.resolve(str(uuid))
        prepared = self._cache.get(found[0]) if found is not None else None
        if prepared is None:
            raise InputError(f"image uuid {uuid!r} names no image this server holds: send the image with it "
                             "(it may have been evicted)")
        return prepared

    def _name_key(self, data: Any, prepared: PreparedImage) -> CacheKey:
        """The preprocessing-cache key a uuid names `prepared` (from `data`) by, its pixels made findable there (a
        memo may have skipped the cache)."""
        self._check_names_usable()
        assert self._cache is not None
        if isinstance(data, (bytes, bytearray, memoryview)):
            key = CacheKey(prepared.raw_digest, self._bytes_ns)
        else:
            key = CacheKey(prepared.raw_digest, self._image_ns)
        if key not in self._cache:
            self._cache.put(key, prepared, prepared.nbytes)
        return key

    def _image(self, data: Any) -> PreparedImage:
        cfg = self.image_config
        if isinstance(data, (bytes, bytearray, memoryview)):
            return prepare_image(
                bytes(data), cfg, model_id=self.model_id, cache=self._cache, limits=self._limits
            )
        if not isinstance(data, (Image.Image, np.ndarray)):
            raise _not_an_image(data)
        source = (checked_rgb_array(data, self._limits) if isinstance(data, np.ndarray)
                  else to_rgb_image(data, self._limits))
        key = CacheKey(pixels_digest(source), self._image_ns)

        def compute() -> tuple[PreparedImage, int]:
            pre = preprocess_image(source, cfg, self._limits)
            out = PreparedImage(
                pixels=pre.pixels,
                grid_thw=pre.grid_thw,
                digest=image_digest(pre, model_id=self.model_id, config=cfg),
                raw_digest=key.raw_digest,
                resized_size=pre.resized_size,
                image_size=pre.image_size,
            )
            return out, out.nbytes

        return self._cached(key, compute)

    def plan_videos(self, videos: Sequence[VideoInput]) -> list[VideoPlan]:
        """Each video's sampling and timestamps settled and the frames it samples checked against `max_video_pixels`
        in all (`media.pixel_budget`, from what each frame announces), nothing decoded: the prompt calls it before
        it prepares its images, so that a prompt refused for its videos decodes nothing (`videos` prepares them)."""
        plans = [self._video_plan(v) for v in videos]
        # a frame sampled many times (num_frames past the frames given) counts each time, its header read once
        check_video_pixels([sampled_frame_sizes(plan.sampling.indices.tolist(), functools.partial(
            self._frame_size, plan.frames)) for plan in plans], self.max_video_pixels)
        return plans

    def _frame_size(self, frames: list[Any], i: int) -> tuple[int, int]:
        return self._announced_size(frames[i], f"video frame {i}")

    def videos(self, plans: Sequence[VideoPlan], memo: MediaMemo | None = None) -> list[PreparedVideo]:
        """The videos `plan_videos` settled, each prepared, its sampled frames decoded once; one whose frames object
        (with the same rate and count) `memo` holds is taken from it, neither decoded nor hashed again (a decision's
        questions on one material: the frames the server hands over encoded are decoded once for all of them)."""
        out = []
        for plan in plans:
            entry = memo.get(plan.memo_key()) if memo is not None else None
            if entry is not None and entry[0] is plan.given and entry[1][0] == plan.timing():
                out.append(entry[1][1])
                continue
            prepared = self._video(plan.frames, plan.sampling, plan.num_frames)
            if memo is not None:
                memo[plan.memo_key()] = (plan.given, (plan.timing(), prepared))
            out.append(prepared)
        return out

    def _video_plan(self, video: VideoInput) -> VideoPlan:
        """A video's frames as a list, its sampling (the config's fps or the video's `num_frames`) and `num_frames`."""
        cfg = self.video_config
        frames = video.frames
        if isinstance(frames, np.ndarray):
            if frames.ndim != 4:
                raise InputError(f"a video array must be uint8 [F, H, W, 3], got shape {list(frames.shape)}")
            frame_list: list[Any] = list(frames)
        elif isinstance(frames, Sequence) and not isinstance(frames, (str, bytes)):
            frame_list = list(frames)
        else:
            raise InputError(f"video frames must be a list or a uint8 array, got {type(frames).__name__}")
        if not frame_list:
            raise InputError("video has no frames")
        fps = checked_rate(video.fps, "video fps", InputError)
        num_frames = video.num_frames
        if num_frames is not None and (
            isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames <= 0
        ):
            raise InputError(f"video num_frames must be a positive int, got {num_frames!r}")
        if num_frames is not None and not cfg.do_sample_frames:
            raise InputError(
                "video num_frames needs frame sampling, which this checkpoint's processor disables"
            )
        return VideoPlan(frame_list, sample_video(len(frame_list), fps, cfg, num_frames=num_frames), num_frames,
                         frames)

    def _video(self, frame_list: list[Any], sampling: VideoSampling, num_frames: int | None) -> PreparedVideo:
        cfg = self.video_config
        rgb = decode_sampled_frames(frame_list, sampling.indices, self._limits)
        # The result depends only on the sampled frames, their indices and the frame rate: key on those.
        h = new_hash()
        hash_field(h, b"scheme", _FRAMES_SCHEME)
        hash_field(h, b"fps", struct.pack("<d", sampling.video_fps))
        hash_field(h, b"num_frames", _U64.pack(num_frames or 0))
        hash_field(h, b"total", _U64.pack(len(frame_list)))
        hash_field(h, b"indices", np.asarray(sampling.indices, dtype="<i8").tobytes())
        for frame in rgb:
            hash_rgb(h, np.asarray(frame))
        key = CacheKey(h.digest(), self._video_ns)

        def compute() -> tuple[PreparedVideo, int]:
            pre = preprocess_sampled_frames(rgb, sampling, cfg)
            out = PreparedVideo(pre, video_digest(pre, model_id=self.model_id, config=cfg))
            return out, out.nbytes

        return self._cached(key, compute)
