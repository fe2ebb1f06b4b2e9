"""Proof that the images' specs bite: each historical bug of pixel keys, image uuids (names), the images' step
token budget, image decoding (formats, the request's pixel budgets, video frames decoded once) and video sampling
(timestamps, frame counts), planted.

Each test monkeypatches one buggy variant into the real component and requires the spec that owns the invariant to
fail (see `specs/planted.py`).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings

from specs.planted import _spec_fails


def test_pixel_keys_missing_the_last_row_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PIL image's key over a view that stops short of its storage (here: all but the last row)."""
    from prism.media import digest as media_digest
    from specs import spec_pixel_keys

    exported = media_digest.exported_rgbx
    monkeypatch.setattr(media_digest, "exported_rgbx",
                        lambda image: None if (rgbx := exported(image)) is None else rgbx[: max(1, len(rgbx) - 1)])
    _spec_fails(spec_pixel_keys.spec_pixel_keys_identify_the_picture, "differ but share a key")


def test_pixel_keys_without_the_shape_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pixel bytes hashed without their shape: the same bytes in another shape would be another's picture."""
    import numpy as np

    from prism.media import digest as media_digest
    from specs import spec_pixel_keys

    monkeypatch.setattr(media_digest, "hash_rgb", lambda h, arr: media_digest.hash_field(
        h, b"pixels", memoryview(np.ascontiguousarray(arr)).cast("B")))
    _spec_fails(spec_pixel_keys.spec_pixel_keys_identify_the_picture, "share a key")


def test_an_image_uuid_re_pointed_at_another_image_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found while building image uuids: names kept in the evicting pixel cache were forgotten with the pixels,
    so a later send of another image under the same uuid re-pointed it. Planted: a bind where the last image
    sent wins."""
    from hypothesis.stateful import run_state_machine_as_test

    from prism.engine import image_names
    from specs.spec_image_uuids import ImageUuidMachine, tour

    def last_wins(self, bindings):
        with self._lock:
            for uuid, key, digest in bindings:
                self._names[uuid] = (key, digest)

    monkeypatch.setattr(image_names.ImageNames, "bind_all", last_wins)
    monkeypatch.setattr(image_names.ImageNames, "check", lambda self, uuid, digest: None)
    with pytest.raises(AssertionError, match="re-pointed|was refused|another image"):
        tour()  # reaches every rule whatever examples Hypothesis draws
        run_state_machine_as_test(ImageUuidMachine, settings=settings(
            max_examples=60, stateful_step_count=25, deadline=None, phases=[Phase.generate], database=None,
            derandomize=True))


def test_names_bound_before_the_engine_accepts_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 27): a chat request's image uuids were bound while its prompt was prepared, so a
    request the engine or the server then refused (too long, max_tokens, a conflict between its own parts) named
    its pictures anyway. Planted: preparing binds the names again, whatever the caller asks."""
    from prism.engine.inputs import InputProcessor
    from specs import spec_refused_requests_name_nothing

    prepare = InputProcessor.prepare_chat

    def binds_at_once(self, messages, **kwargs):
        kwargs["bind_names"] = True
        return prepare(self, messages, **kwargs)

    monkeypatch.setattr(InputProcessor, "prepare_chat", binds_at_once)
    _spec_fails(spec_refused_requests_name_nothing.spec_a_refused_request_names_nothing, "is bound")


def test_images_over_the_step_budget_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 27): an image larger than one step's tokens was refused (a 400 for every 12 MP photo
    on the 8B config) instead of downscaled. Planted: the budget ignored again."""
    from prism.media.config import ImageProcessorConfig
    from specs import spec_image_token_budget

    monkeypatch.setattr(ImageProcessorConfig, "within_tokens", lambda self, tokens: self)
    _spec_fails(spec_image_token_budget.spec_every_image_fits_the_step, "more than the step")


def test_small_budgets_left_above_by_rounding_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 28): the budget's second smart resize rounds each side up, so a small or thin image
    could stay above a small step's budget. Planted: `target_size` without taking whole factors off after it."""
    from prism.media.image import smart_resize
    from specs import spec_image_token_budget

    def two_smart_resizes(height, width, config):
        h, w = smart_resize(height, width, factor=config.factor, min_pixels=config.min_pixels,
                            max_pixels=config.max_pixels)
        budget = None if config.step_tokens is None else config.step_tokens * config.factor**2
        if budget is not None and h * w > budget:
            h, w = smart_resize(height, width, factor=config.factor, min_pixels=min(config.min_pixels, budget),
                                max_pixels=budget)
        return h, w

    monkeypatch.setattr(spec_image_token_budget, "target_size", two_smart_resizes)
    _spec_fails(spec_image_token_budget.spec_every_image_fits_even_a_small_step, "the step has")


def test_decoding_every_format_pillow_opens_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the media bug hunt: client bytes were opened in any format Pillow knows, and an EPS was
    decoded by running Ghostscript on them. Planted: `Image.open` without a list of formats again."""
    from prism.media import image
    from specs import spec_image_decoding

    monkeypatch.setattr(image, "decoded_formats", lambda: None)
    _spec_fails(spec_image_decoding.spec_decoding_runs_no_program_and_decodes_as_hf, "started")


def test_a_format_decoded_as_it_opens_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review of session 33: ICO was accepted, and Pillow decodes an icon's whole picture as it opens
    it, before the size limits (per image, per request) could judge it. Planted: ICO accepted again."""
    from prism.media import image
    from specs import spec_image_decoding

    monkeypatch.setattr(image, "ACCEPTED_FORMATS", (*image.ACCEPTED_FORMATS, "ICO"))
    monkeypatch.setattr(image, "decoded_formats", lambda: image.ACCEPTED_FORMATS)
    _spec_fails(spec_image_decoding.spec_every_accepted_format_opens_from_its_header, "decoded its pixels")


def test_a_frame_count_past_the_floats_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the media bug hunt: a video at a tiny (subnormal) fps made `int(total / fps * 2)` an
    OverflowError, a 500. Planted: the frame count at the sampling fps unguarded again."""
    from prism.media import video
    from specs import spec_video_sampling

    def unguarded(total_frames, video_fps, fps, config):
        return min(max(int(total_frames / video_fps * fps), config.min_frames), config.max_frames, total_frames)

    monkeypatch.setattr(video, "_frames_at_fps", unguarded)
    _spec_fails(spec_video_sampling.spec_any_frame_rate_is_a_video_or_a_video_error, "infinity", OverflowError)


def test_timestamps_past_the_floats_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same hunt: frames kept as given (no sampling) at a subnormal fps got `<inf seconds>` timestamps. Planted:
    HF's timestamps, unchecked."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from prism.media import video
    from specs import spec_video_sampling

    monkeypatch.setattr(video, "frame_group_timestamps", lambda indices, video_fps, temporal_patch_size:
                        Qwen3VLProcessor._calculate_timestamps(None, [int(i) for i in indices], video_fps,
                                                                            temporal_patch_size))
    _spec_fails(spec_video_sampling.spec_any_frame_rate_is_a_video_or_a_video_error, "HF does not make")


def test_images_without_a_pixel_budget_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the media hunt (session 30): video frames had a per-request pixel budget, images none, so a request
    of many images each under the per-image limit (~89 M pixels) decoded them all. Planted: no budget, in the
    server's resolver and in the engine."""
    from prism.engine import media_preparation
    from prism.serving import media_urls
    from specs import spec_image_decoding

    monkeypatch.setattr(media_preparation, "check_image_pixels", lambda sizes, limit: None)
    monkeypatch.setattr(media_urls, "check_image_pixels", lambda sizes, limit: None)
    _spec_fails(spec_image_decoding.spec_a_requests_images_are_accepted_iff_their_pixels_fit_the_budget,
                "accepted images of")


def test_a_pixel_budget_checked_after_decoding_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plausible: the engine's budget judged once the images are prepared (their sizes known for free): a refused
    request has decoded them, and left them in the preprocessing cache. Planted: the check after the preparation."""
    from prism.engine.media_preparation import MediaPreparer
    from specs import spec_image_decoding

    check, prepare = MediaPreparer._check_pixel_budget, MediaPreparer.images

    def decoded_first(self, images, memo, on_image=None):
        prepared = prepare(self, images, memo, on_image)
        check(self, images, memo)
        return prepared

    monkeypatch.setattr(MediaPreparer, "_check_pixel_budget", lambda self, images, memo: None)
    monkeypatch.setattr(MediaPreparer, "images", decoded_first)
    _spec_fails(spec_image_decoding.spec_a_requests_images_are_accepted_iff_their_pixels_fit_the_budget,
                "were decoded")


def test_data_urls_of_a_refused_request_cached_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plausible: the resolver caching each data URL as it decodes it (as it did before the budget): a request
    refused for its pixels leaves its payloads in the decoded-URL cache. Planted: the cache filled at once."""
    from prism.serving.media_urls import MediaResolver
    from specs import spec_image_decoding

    data_url = MediaResolver._data_url

    def cached_at_once(self, url, param, budget):
        data = data_url(self, url, param, budget)
        self._decoded.put(url, data)
        return data

    monkeypatch.setattr(MediaResolver, "_data_url", cached_at_once)
    _spec_fails(spec_image_decoding.spec_a_requests_images_are_accepted_iff_their_pixels_fit_the_budget,
                "data URLs were cached")


def test_video_frames_without_a_pixel_budget_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review of session 35: offline, the frames of a prompt's videos had no pixel budget (the server's
    max_video_pixels bounds only what it decodes itself). Planted: no budget in the engine again."""
    from prism.engine import media_preparation
    from specs import spec_image_decoding

    monkeypatch.setattr(media_preparation, "check_video_pixels", lambda videos, limit: None)
    _spec_fails(spec_image_decoding.spec_a_prompts_video_frames_are_accepted_iff_their_sampled_pixels_fit_the_budget,
                "accepted video frames of")


def test_video_frames_decoded_twice_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same review: each sampled frame given as bytes was decoded for the video's cache key, then again by
    `preprocess_video` for its pixels. Planted: that preparation again."""
    import struct

    import numpy as np

    from prism.engine import media_preparation
    from prism.engine.media_preparation import MediaPreparer, PreparedVideo
    from prism.media.cache import CacheKey
    from prism.media.digest import hash_field, hash_rgb, new_hash, video_digest
    from prism.media.image import to_rgb_image
    from prism.media.video import preprocess_video
    from specs import spec_image_decoding

    def decoded_twice(self, frame_list, sampling, num_frames):
        h = new_hash()
        hash_field(h, b"scheme", media_preparation._FRAMES_SCHEME)
        hash_field(h, b"fps", struct.pack("<d", sampling.video_fps))
        hash_field(h, b"num_frames", media_preparation._U64.pack(num_frames or 0))
        hash_field(h, b"total", media_preparation._U64.pack(len(frame_list)))
        hash_field(h, b"indices", np.asarray(sampling.indices, dtype="<i8").tobytes())
        for i in sampling.indices.tolist():
            hash_rgb(h, np.asarray(to_rgb_image(frame_list[i], self._limits, what=f"video frame {i}")))

        def compute():
            pre = preprocess_video(frame_list, sampling.video_fps, self.video_config, num_frames=num_frames,
                                   limits=self._limits)
            out = PreparedVideo(pre, video_digest(pre, model_id=self.model_id, config=self.video_config))
            return out, out.nbytes

        return self._cached(CacheKey(h.digest(), self._video_ns), compute)

    monkeypatch.setattr(MediaPreparer, "_video", decoded_twice)
    _spec_fails(spec_image_decoding.spec_a_prompts_video_frames_are_accepted_iff_their_sampled_pixels_fit_the_budget,
                "each is decoded once")


def test_timestamps_past_a_tenth_of_a_second_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same review: a video_fps of 1e-300 gave 300-digit timestamps (HF's too), digits of a float that no longer
    tells tenths of a second apart. Planted: timestamps only required to be finite again."""
    from prism.media import video
    from specs import spec_video_sampling

    monkeypatch.setattr(video, "MAX_TIMESTAMP_SECONDS", float("inf"))
    _spec_fails(spec_video_sampling.spec_any_frame_rate_is_a_video_or_a_video_error, "made a video HF does not make")


def test_a_frame_count_past_max_frames_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same review: the offline `num_frames` was unbounded (10**12 asked for a 7 TiB array of indices). Planted:
    HF's rule, any count sampled as is."""
    import numpy as np

    from prism.media import video
    from specs import spec_video_sampling

    sample = video.sample_frame_indices

    def any_count(total_frames, video_fps, config, *, fps=None, num_frames=None):
        if num_frames is None:
            return sample(total_frames, video_fps, config, fps=fps)
        return np.linspace(0, total_frames - 1, num_frames).round().astype(np.int64)

    monkeypatch.setattr(video, "sample_frame_indices", any_count)
    _spec_fails(spec_video_sampling.spec_a_frame_count_is_sampled_as_hf_up_to_max_frames, "num_frames=")


def test_video_budget_judged_after_the_images_are_decoded_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by session 34's review of the video budget: a prompt's videos were sampled and checked against
    `max_video_pixels` only after its images were decoded, cached and (in the engine) encoded, so a prompt refused
    for its videos had done all of that for nothing. Planted: the videos planned when they are prepared again."""
    from prism.engine.media_preparation import MediaPreparer
    from specs import spec_image_decoding

    plan, prepare = MediaPreparer.plan_videos, MediaPreparer.videos
    monkeypatch.setattr(MediaPreparer, "plan_videos", lambda self, videos: videos)
    monkeypatch.setattr(MediaPreparer, "videos", lambda self, videos, memo=None: prepare(self, plan(self, videos), memo))
    _spec_fails(spec_image_decoding.spec_a_prompts_video_frames_are_accepted_iff_their_sampled_pixels_fit_the_budget,
                "a refused prompt decoded")


def test_a_frame_past_its_own_limit_blamed_on_the_budget_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by session 34's review: the server refused a video frame past one frame's limit (89,478,485 pixels) as
    exceeding `max_video_pixels`, even when the request had more than that left. Planted: that message again."""
    from prism.serving import video_frames
    from prism.serving.media_urls import MediaTooLarge
    from specs import spec_image_decoding

    monkeypatch.setattr(video_frames, "_frame_limit_error", lambda exc, limits, param: MediaTooLarge(
        f"the decoded video frames of this request exceed max_video_pixels ({exc})", param=param))
    _spec_fails(spec_image_decoding.spec_a_video_frame_refused_names_the_limit_it_crossed,
                "within the .* its request has left")


def test_a_video_sampling_refused_only_by_the_engine_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in session 36: the server fetched and decoded every frame of a request, and cached its data URLs, before
    the engine refused the video's fps (64 frames of 640 x 480 at fps=1e-300). Planted: the server does not settle the
    sampling (it counts every frame sent, as it did then)."""
    import numpy as np

    from prism.media.video import VideoSampling
    from prism.serving import media_urls
    from specs import spec_server_video_refusals

    monkeypatch.setattr(media_urls, "check_sampling", lambda part, where, config: VideoSampling(
        np.arange(len(part.video.frames)), (), part.video.fps))
    _spec_fails(spec_server_video_refusals.spec_a_servers_video_refusals_come_before_any_frame_is_decoded,
                "the server accepted videos")


def test_frames_decoded_before_the_pixels_are_judged_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in session 36: the server decoded a request's frames as it fetched them, each judged against what the
    budget had left, so a request past `max_video_pixels` had its frames decoded up to the one that crossed it.
    Planted: the frames decoded before their pixels are judged."""
    from prism.serving import media_urls, video_frames
    from specs import spec_server_video_refusals

    judge = video_frames.check_frame_pixels

    def decoded_first(videos, max_video_pixels, max_bytes, whose_limit=""):
        _decode_every_frame(videos, max_bytes)
        judge(videos, max_video_pixels, max_bytes, whose_limit)

    monkeypatch.setattr(media_urls, "check_frame_pixels", decoded_first)
    _spec_fails(spec_server_video_refusals.spec_a_servers_video_refusals_come_before_any_frame_is_decoded,
                "the server decoded")


def _decode_every_frame(videos, max_bytes: int) -> None:
    """The server's frame decoding of session 36: every frame sent decoded into its video's part."""
    from prism.media.image import DecodeLimits, decode_image

    for video in videos:
        video.part["video"] = [decode_image(data, DecodeLimits(max_bytes=max_bytes)) for data, _ in video.frames]


def test_a_server_decoding_every_frame_sent_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in session 37: the server decoded every frame of a video it accepted and handed them over decoded; the
    engine sampled them and used only those (4 of a 30 fps video's 64 frames). Planted: every frame decoded again once
    the pixels are judged."""
    from prism.serving import media_urls, video_frames
    from specs import spec_server_video_frames

    judge = video_frames.check_frame_pixels

    def then_decoded(videos, max_video_pixels, max_bytes, whose_limit=""):
        judge(videos, max_video_pixels, max_bytes, whose_limit)
        _decode_every_frame(videos, max_bytes)

    monkeypatch.setattr(media_urls, "check_frame_pixels", then_decoded)
    _spec_fails(spec_server_video_frames.spec_a_video_sent_to_the_server_is_prepared_as_its_frames_decoded_whole,
                "frames decoded for the")


def test_a_server_handing_over_only_the_sampled_frames_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plausible shortcut to decoding only the sampled frames: the server hands the engine just those, at the
    video's rate, and the engine samples them again as a video of their own (other frames, other timestamps).
    Planted: that shortcut."""
    from prism.serving import media_urls, video_frames
    from specs import spec_server_video_frames

    judge = video_frames.check_frame_pixels

    def then_cut(videos, max_video_pixels, max_bytes, whose_limit=""):
        judge(videos, max_video_pixels, max_bytes, whose_limit)
        for video in videos:
            video.part["video"] = [video.frames[i][0] for i in dict.fromkeys(video.sampling.indices.tolist())]

    monkeypatch.setattr(media_urls, "check_frame_pixels", then_cut)
    _spec_fails(spec_server_video_frames.spec_a_video_sent_to_the_server_is_prepared_as_its_frames_decoded_whole,
                "differs from their frames decoded whole")


def test_too_few_frames_refused_after_decoding_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in session 36: a video sampling fewer frames than a temporal patch (one frame) was refused only by the
    smart resize, after the server and the engine had decoded its frames. Planted: the sampling without that check."""
    import numpy as np

    from prism.engine import media_preparation
    from prism.media import video
    from prism.serving import video_frames
    from specs import spec_server_video_refusals

    def unchecked(total_frames, video_fps, config, *, fps=None, num_frames=None, sample=None):
        video_fps = video._check_fps(video_fps, "video_fps")
        if config.do_sample_frames if sample is None else sample:
            indices = video.sample_frame_indices(total_frames, video_fps, config, fps=fps, num_frames=num_frames)
        else:
            indices = np.arange(total_frames, dtype=np.int64)
        stamps = video.frame_group_timestamps(indices, video_fps, config.temporal_patch_size)
        return video.VideoSampling(indices=indices, timestamps=tuple(stamps), video_fps=video_fps)

    monkeypatch.setattr(video_frames, "sample_video", unchecked)
    monkeypatch.setattr(media_preparation, "sample_video", unchecked)
    _spec_fails(spec_server_video_refusals.spec_a_servers_video_refusals_come_before_any_frame_is_decoded,
                "decoded 1 frames of videos it refused|the server accepted videos")


def test_a_checkpoints_frame_count_past_max_frames_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in session 36: a checkpoint's video config with `num_frames=10**9` loaded, and the engine then refused
    every video, blaming a `num_frames` the request never gave. Planted: the config's count unbounded."""
    from prism.media.config import VideoProcessorConfig
    from specs import spec_video_sampling

    checked = VideoProcessorConfig.__post_init__

    def unbounded(self):
        count = self.num_frames
        object.__setattr__(self, "num_frames", None)
        checked(self)
        object.__setattr__(self, "num_frames", count)

    monkeypatch.setattr(VideoProcessorConfig, "__post_init__", unbounded)
    _spec_fails(spec_video_sampling.spec_a_checkpoints_frame_count_loads_iff_within_max_frames, "loaded, past")


def test_an_engines_pixel_limit_refused_as_the_servers_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by session 34's review: the server refuses at the lower of its own and the engine config's pixel
    limits, and a 413 at the engine's (2**27 for video frames, whatever `PRISM_MAX_VIDEO_PIXELS` said) did not say
    where that limit came from. Planted: no word of it again."""
    from prism.serving.media_urls import MediaResolver
    from specs import spec_image_decoding

    monkeypatch.setattr(MediaResolver, "_engines_limit", lambda self, name: "")
    _spec_fails(spec_image_decoding.spec_a_servers_pixel_refusal_says_whose_limit_it_is, "the engine's")


def test_the_servers_engine_ignoring_the_servers_pixel_budgets_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in session 34: the engine a server builds took its config file's pixel budgets or the defaults, never the
    server's `PRISM_MAX_*_PIXELS`. Planted: the file or the defaults only."""
    from prism.engine.config import EngineConfig
    from prism.serving import server_state
    from specs import spec_image_decoding

    monkeypatch.setattr(server_state, "engine_config_of", lambda settings: (
        EngineConfig.from_json(settings.engine_config_path) if settings.engine_config_path else EngineConfig()))
    _spec_fails(spec_image_decoding.spec_the_engine_a_server_builds_takes_the_servers_pixel_budgets, "the engine's")


def _old_config_rate(value, name, error):
    """The video processor config's check of its fps before session 37: any positive number, inf included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise error(f"{name} must be a positive number or null, got {value!r}")
    return float(value)


def test_a_checkpoints_infinite_sampling_rate_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in session 37: a checkpoint's video config with `fps` of inf loaded, and every video was then refused
    ("target fps must be a positive finite number"). Planted: the config's old check (any positive number)."""
    from prism.media import config
    from specs import spec_video_sampling

    monkeypatch.setattr(config, "checked_sampling_rate", _old_config_rate)
    _spec_fails(spec_video_sampling.spec_a_checkpoints_sampling_rate_loads_iff_every_video_is_sampled_as_hf,
                "fps=inf loaded, then refused two frames")


def test_a_checkpoints_sampling_rate_past_the_floats_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in session 37: a checkpoint's video config with `fps` of 1e300 loaded, and then refused any video longer
    than 1.8e8 seconds of frames, blamed on its `video_fps` (the frame count to sample overflowed). Planted: the
    config's rate checked as a request's only (positive and finite), without the sampling rate's bound (the sampling
    then refuses the config's rate, as every rate it samples at is checked)."""
    from prism.media import config, rates
    from specs import spec_video_sampling

    monkeypatch.setattr(config, "checked_sampling_rate", rates.checked_rate)
    _spec_fails(spec_video_sampling.spec_a_checkpoints_sampling_rate_loads_iff_every_video_is_sampled_as_hf,
                r"fps=1e\+300 loaded, then refused two frames")
