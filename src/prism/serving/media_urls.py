"""Media URLs of a chat request -> the messages `InputProcessor.prepare_chat` takes (image and frame bytes).

Owns where media may come from and how much of it a request may bring, so that hostile URLs become 4xx
answers before memory or time is spent:
- `data:image/*;base64,...`: size checked from the encoded length before decoding; strict base64.
- `file://` URLs and absolute paths: only with `media_root` set, and only when the real path (symlinks and
  `..` resolved) lies inside it; outside the root is refused without telling whether the file exists.
  FIFOs, devices and directories are refused (opened non-blocking, checked with fstat).
- `http(s)://`: only with `allow_remote_media`; streamed with a byte cap, an overall deadline and a
  bounded number of redirects. Any host is reachable, private addresses included: switch it on only where
  the server's network neighbours are trusted.
- counts: at most `max_media_per_request` items (images + videos), `max_video_frames` frames per video, and
  `max_request_bytes` of media bytes in all (whatever their source);
- videos: each one's frame count and rate within what the engine's sampling takes, before any frame is fetched
  (`video_frames.check_sampling`);
- pixels: the images at most `max_image_pixels` in all (`media.pixel_budget`), the frames the videos sample at most
  `max_video_pixels` in all (`video_frames.check_frame_pixels`; every frame sent is read from its header, each within
  one frame's limit), each read from its header once every source is read and before any image or frame is decoded
  (an image named by its uuid alone carries none).

A request refused here leaves nothing behind: the data URLs it decoded join the decoded-URL cache only once all of its
media are resolved within these limits, and nothing is decoded here. One resolved here and refused by the engine
afterwards (a prompt too long, an image or sampled frame body that does not decode, a full server) leaves its data URLs
cached: an entry is found only by the whole URL and the cache is bounded by its bytes (`data_url_cache_bytes`), so a
later request that finds one gets the bytes its URL decodes to, judged by the same limits: its verdict and its answer
are a miss's (and a client that sends the request again skips the base64 decode).

Status codes (`MediaURLError.status`): 403 for a source this server refuses (local file outside or without
`media_root`, remote media switched off, unreadable file), 413 for too many bytes or pixels, 400 for the rest
(malformed URL or base64, missing file, remote error or timeout, too many items, an undecodable image or frame
header).

`video_url` (an encoded video file) is refused with 400: no video decoder is installed; send decoded
frames as `{"type": "video", "video": {"frames": [...], "fps": ...}}`. Those frames go to `prepare_chat` encoded, as
images do: the engine decodes the ones it samples, each once, and no other (`video_frames`).
The resolver is synchronous and holds no per-request state: run it on worker threads.
"""

from __future__ import annotations

import binascii
import os
import stat
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from ..media.config import VideoProcessorConfig
from ..media.errors import ImagePixelBudgetError, ImageTooLargeError, MediaError
from ..media.image import DecodeLimits, header_size
from ..media.pixel_budget import check_image_pixels
from ..media.video import VideoSampling
from .data_url_cache import DecodedDataURLs
from .media_url_errors import (  # noqa: F401 - the resolver's refusals, importable from here
    ForbiddenMedia,
    InvalidMediaData,
    InvalidMediaURL,
    InvalidVideo,
    MediaFetchError,
    MediaFetchTimeout,
    MediaNotFound,
    MediaTooLarge,
    MediaURLError,
    TooManyMedia,
    UnsupportedMedia,
)
from .protocol import (
    ChatMessage,
    ImageURLPart,
    SystemMessage,
    TextPart,
    VideoPart,
    VideoURLPart,
)
from .settings import ServerSettings
from .video_frames import SentVideo, check_frame_pixels, check_sampling


def _shown(url: str) -> str:
    return repr(url if len(url) <= 60 else url[:57] + "...")


class _Budget:
    """Media bytes left to one request; its images (bytes and field, None for one named by its uuid alone) and
    videos so far with the frames each samples, and the data URLs it decoded, kept for the decoded-URL cache until it
    is resolved."""

    def __init__(self, max_bytes: int, samplings: Sequence[VideoSampling] = ()) -> None:
        self.bytes_left = max_bytes
        self.samplings = samplings  # each video's, in the request's order (`video_frames.check_sampling`)
        self.images: list[tuple[bytes, str] | None] = []
        self.videos: list[SentVideo] = []
        self.decoded: dict[str, bytes] = {}

    def take_bytes(self, n: int, param: str | None) -> None:
        if n > self.bytes_left:
            raise MediaTooLarge("the media of this request exceed max_request_bytes in total", param=param)
        self.bytes_left -= n


class _Fetcher:
    """One httpx client per resolve call, opened on the first remote URL."""

    def __init__(self, settings: ServerSettings, transport: httpx.BaseTransport | None) -> None:
        self._settings = settings
        self._transport = transport
        self._client: httpx.Client | None = None

    def client(self) -> httpx.Client:
        if self._client is None:
            s = self._settings
            self._client = httpx.Client(
                transport=self._transport,
                timeout=httpx.Timeout(s.remote_media_timeout_s),
                follow_redirects=s.remote_media_max_redirects > 0,
                max_redirects=s.remote_media_max_redirects,
                trust_env=False,  # no proxies / netrc from the server's environment
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class MediaResolver:
    """Resolves the media URLs of validated chat messages under `settings`' limits.

    `transport` (an `httpx.BaseTransport`, e.g. `httpx.MockTransport`) replaces the network for remote URLs.
    `max_image_pixels` and `max_video_pixels` (the engine's, where they are lower) replace the settings' own: the
    server then refuses here whatever the engine would, before anything is cached (both count the frames each video
    samples). `video_config`: the engine's video processor settings, which
    videos are sampled by (Qwen3-VL's defaults, an engine's whose checkpoint has no video config, when None).
    """

    def __init__(self, settings: ServerSettings, *, transport: httpx.BaseTransport | None = None,
                 max_image_pixels: int | None = None, max_video_pixels: int | None = None,
                 video_config: VideoProcessorConfig | None = None) -> None:
        self.settings = settings
        self.max_image_pixels = settings.max_image_pixels if max_image_pixels is None else max_image_pixels
        self.max_video_pixels = settings.max_video_pixels if max_video_pixels is None else max_video_pixels
        self.video_config = VideoProcessorConfig() if video_config is None else video_config
        self._transport = transport
        self._decoded = DecodedDataURLs(settings.data_url_cache_bytes)

    # ---------------------------------------------------------------------------------- messages
    def resolve_messages(self, messages: Sequence[ChatMessage], field: str = "messages") -> list[dict[str, Any]]:
        """Protocol messages -> `prepare_chat` messages: text kept, images as encoded bytes
        (`{"type": "image", "image": bytes}`, with the part's `uuid` if any; `"image": None` when named by uuid
        alone), videos as their frames' encoded bytes (`{"type": "video", "video": [bytes, ...], "fps": fps}`: the
        engine decodes the frames it samples); "developer" becomes "system". `field`: the
        request's name for these messages in error locations (a decide's are its "material")."""
        samplings = self._check_before_fetching(messages, field)
        s = self.settings
        budget = _Budget(s.max_request_bytes, samplings)
        fetcher = _Fetcher(s, self._transport)
        try:
            out = []
            for i, message in enumerate(messages):
                role = "system" if isinstance(message, SystemMessage) else message.role
                content = message.content
                if isinstance(content, list):
                    content = [
                        self._resolve_part(part, f"{field}[{i}].content[{j}]", budget, fetcher)
                        for j, part in enumerate(content)
                    ]
                out.append({"role": role, "content": content})
        finally:
            fetcher.close()
        self._check_image_pixels(budget.images)
        check_frame_pixels(budget.videos, self.max_video_pixels, s.max_media_bytes,
                           self._engines_limit("max_video_pixels"))
        self._keep_decoded(budget)
        return out

    def resolve_url(self, url: str, *, param: str | None = None) -> bytes:
        """The bytes behind one media URL (data:, file://, absolute path, http(s)://) under the limits."""
        s = self.settings
        fetcher = _Fetcher(s, self._transport)
        budget = _Budget(s.max_request_bytes)
        try:
            data = self._fetch(url, param, budget, fetcher)
        finally:
            fetcher.close()
        self._keep_decoded(budget)
        return data

    def _check_image_pixels(self, images: list[tuple[bytes, str] | None]) -> None:
        """The request's images within `max_image_pixels` in all, from their headers (`media.pixel_budget`)."""
        limits = DecodeLimits(max_bytes=self.settings.max_media_bytes)
        sizes = []
        for image in images:
            if image is None:
                sizes.append(None)
                continue
            data, param = image
            try:
                sizes.append(header_size(data, limits))
            except ImageTooLargeError as exc:
                raise MediaTooLarge(str(exc), param=param) from exc
            except MediaError as exc:
                raise InvalidMediaData(str(exc), param=param) from exc
        try:
            check_image_pixels(sizes, self.max_image_pixels)
        except ImagePixelBudgetError as exc:
            crossing = images[exc.index]  # an image with pixels: theirs took the total past the limit
            raise MediaTooLarge(f"{exc}{self._engines_limit('max_image_pixels')}",
                                param=crossing[1] if crossing else None) from exc

    def _engines_limit(self, name: str) -> str:
        """For a 413 naming the pixel limit `name`: where it comes from when it is the engine config's, below the
        server's own `PRISM_` variable (an operator who raised only the variable reads why the limit did not move)."""
        limit, own = getattr(self, name), getattr(self.settings, name)
        return f" ({name}={limit} is the engine config's, below PRISM_{name.upper()}={own})" if limit < own else ""

    def _keep_decoded(self, budget: _Budget) -> None:
        for url, data in budget.decoded.items():
            self._decoded.put(url, data)

    def _check_before_fetching(self, messages: Sequence[ChatMessage], field: str = "messages"
                               ) -> list[VideoSampling]:
        """What the request's parts alone decide: no video_url, the counts of items and frames, each video's sampling
        (`video_frames.check_sampling`; returned in the request's order)."""
        items, videos = 0, []
        for i, message in enumerate(messages):
            if not isinstance(message.content, list):
                continue
            for j, part in enumerate(message.content):
                where = f"{field}[{i}].content[{j}]"
                if isinstance(part, VideoURLPart):
                    raise UnsupportedMedia(
                        "video_url is not supported (no video decoder on this server); send decoded frames as "
                        '{"type": "video", "video": {"frames": [image URLs], "fps": ...}}',
                        param=where,
                    )
                if isinstance(part, VideoPart) and len(part.video.frames) > self.settings.max_video_frames:
                    raise TooManyMedia(
                        f"a video may have at most {self.settings.max_video_frames} frames, "
                        f"got {len(part.video.frames)}",
                        param=f"{where}.video.frames",
                    )
                if isinstance(part, VideoPart):
                    videos.append((part, where))
                items += not isinstance(part, TextPart)
        if items > self.settings.max_media_per_request:
            raise TooManyMedia(
                f"a request may carry at most {self.settings.max_media_per_request} images and videos, got {items}",
                param="messages",
            )
        return [check_sampling(part, where, self.video_config) for part, where in videos]

    def _resolve_part(self, part: Any, where: str, budget: _Budget, fetcher: _Fetcher) -> dict[str, Any]:
        if isinstance(part, TextPart):
            return {"type": "text", "text": part.text}
        if isinstance(part, ImageURLPart):
            if part.image_url is None:  # named by its uuid: the input processor finds it, or answers 400
                budget.images.append(None)
                return {"type": "image", "image": None, "uuid": part.uuid}
            param = f"{where}.image_url.url"
            image = self._fetch(part.image_url.url, param, budget, fetcher)
            budget.images.append((image, param))
            return {"type": "image", "image": image} | ({"uuid": part.uuid} if part.uuid is not None else {})
        if isinstance(part, VideoPart):  # its frames judged once the request's sources are all read
            video = SentVideo({"type": "video", "video": [], "fps": part.video.fps},
                              budget.samplings[len(budget.videos)])
            for k, url in enumerate(part.video.frames):
                param = f"{where}.video.frames[{k}]"
                video.frames.append((self._fetch(url, param, budget, fetcher), param))
            video.part["video"] = [data for data, _ in video.frames]
            budget.videos.append(video)
            return video.part
        raise TypeError(f"{where}: not a validated content part: {type(part).__name__}")

    # ---------------------------------------------------------------------------------- sources
    def _fetch(self, url: str, param: str | None, budget: _Budget, fetcher: _Fetcher) -> bytes:
        head = url[:8].lower()
        if head.startswith("data:"):
            return self._data_url(url, param, budget)
        if head.startswith(("http://", "https://")):
            return self._remote(url, param, budget, fetcher)
        if head.startswith("file:") or url.startswith("/"):
            return self._local(url, param, budget)
        raise InvalidMediaURL(
            f"unsupported media URL {_shown(url)}: expected data:, file://, an absolute path, http:// or https://",
            param=param,
        )

    def _data_url(self, url: str, param: str | None, budget: _Budget) -> bytes:
        cached = budget.decoded.get(url)  # the same URL passed every check below before
        if cached is None:
            cached = self._decoded.get(url)
        if cached is not None:
            budget.take_bytes(len(cached), param)
            return cached
        comma = url.find(",")
        if comma < 0:
            raise InvalidMediaURL("data URL has no ',' before its payload", param=param)
        mime, *options = (p.strip().lower() for p in url[5:comma].split(";"))
        if not mime.startswith("image/"):
            raise InvalidMediaURL(f"data URL media type must be image/*, got {mime or 'none'!r}", param=param)
        if "base64" not in options:
            raise InvalidMediaURL("data URLs must be base64-encoded (';base64,')", param=param)
        payload = "".join(url[comma + 1 :].split())  # line breaks (MIME-style base64) are not data
        padding = len(payload) - len(payload.rstrip("="))
        size = len(payload) // 4 * 3 - min(padding, 2)
        limit = self.settings.max_media_bytes
        if size > limit:  # refused before decoding anything
            raise MediaTooLarge(f"data URL holds {size} bytes; the limit is {limit}", param=param)
        if not payload:  # a payload of 1-3 characters has a size of 0 too: not empty, but not base64 (below)
            raise InvalidMediaURL("data URL payload is empty", param=param)
        budget.take_bytes(size, param)
        try:
            data = binascii.a2b_base64(payload.encode("ascii"), strict_mode=True)
        except (binascii.Error, UnicodeEncodeError) as exc:
            raise InvalidMediaURL(f"data URL payload is not valid base64: {exc}", param=param) from None
        budget.decoded[url] = data
        return data

    def _local(self, url: str, param: str | None, budget: _Budget) -> bytes:
        root = self.settings.media_root
        if url[:5].lower() == "file:":
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
                raise InvalidMediaURL(f"file URL {_shown(url)} must be file:///absolute/path", param=param)
            path = unquote(parts.path)
        else:
            path = url
        if root is None:
            raise ForbiddenMedia("local media files are disabled on this server (no media root)", param=param)
        if "\x00" in path or not os.path.isabs(path):
            raise InvalidMediaURL(f"local media path {_shown(path)} must be absolute", param=param)
        real = os.path.realpath(path)  # symlinks and '..' resolved: containment is checked on the real path
        if os.path.commonpath([real, str(root)]) != str(root):
            raise ForbiddenMedia(f"{_shown(path)} is outside the media root", param=param)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(real, flags)
        except FileNotFoundError:
            raise MediaNotFound(f"no such file: {_shown(path)}", param=param) from None
        except OSError as exc:  # permissions, or a symlink swapped in after the check (ELOOP)
            raise ForbiddenMedia(f"cannot open {_shown(path)}: {exc.strerror}", param=param) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidMediaURL(f"{_shown(path)} is not a regular file", param=param)
            limit = self.settings.max_media_bytes
            if info.st_size > limit:
                raise MediaTooLarge(f"file is {info.st_size} bytes; the limit is {limit}", param=param)
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(limit + 1)  # the file may have grown since fstat
        finally:
            os.close(fd)
        if len(data) > limit:
            raise MediaTooLarge(f"file is more than {limit} bytes", param=param)
        if not data:
            raise InvalidMediaURL(f"{_shown(path)} is empty", param=param)
        budget.take_bytes(len(data), param)
        return data

    def _remote(self, url: str, param: str | None, budget: _Budget, fetcher: _Fetcher) -> bytes:
        s = self.settings
        if not s.allow_remote_media:
            raise ForbiddenMedia(
                "remote media URLs are disabled on this server (PRISM_ALLOW_REMOTE_MEDIA=1 enables them)",
                param=param,
            )
        limit = s.max_media_bytes
        deadline = time.monotonic() + s.remote_media_timeout_s
        timeout_msg = f"fetching {_shown(url)} took longer than {s.remote_media_timeout_s:g} s"
        try:
            with fetcher.client().stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise MediaFetchError(
                        f"fetching {_shown(url)} returned HTTP {resp.status_code}", param=param
                    )
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise MediaTooLarge(
                        f"remote media is {declared} bytes; the limit is {limit}", param=param
                    )
                data = bytearray()
                for chunk in resp.iter_bytes():  # decoded bytes: a compressed bomb hits the cap too
                    data += chunk
                    if len(data) > limit:
                        raise MediaTooLarge(f"remote media is more than {limit} bytes", param=param)
                    if time.monotonic() > deadline:  # a slow drip within each read timeout
                        raise MediaFetchTimeout(timeout_msg, param=param)
        except httpx.TimeoutException:
            raise MediaFetchTimeout(timeout_msg, param=param) from None
        except httpx.TooManyRedirects:
            raise MediaFetchError(
                f"fetching {_shown(url)} took more than {s.remote_media_max_redirects} redirects", param=param
            ) from None
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            raise InvalidMediaURL(f"bad remote URL {_shown(url)}: {exc}", param=param) from None
        except httpx.HTTPError as exc:
            raise MediaFetchError(
                f"fetching {_shown(url)} failed: {type(exc).__name__}: {exc}", param=param
            ) from None
        if not data:
            raise MediaFetchError(f"{_shown(url)} returned no data", param=param)
        budget.take_bytes(len(data), param)
        return bytes(data)
