"""Media URL resolution (prism.serving.media_urls) and the server settings (prism.serving.settings): every
source is refused unless allowed, every limit is checked before the bytes are held, and what comes out is
what `InputProcessor.prepare_chat` accepts. No test touches a network: remote fetches go to an
`httpx.MockTransport` or to an `http.server` on 127.0.0.1 started (and stopped) by the test."""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image, ImageFile

from prism.serving.data_url_cache import DecodedDataURLs
from prism.serving.media_urls import (
    ForbiddenMedia,
    InvalidMediaData,
    InvalidMediaURL,
    InvalidVideo,
    MediaFetchError,
    MediaFetchTimeout,
    MediaNotFound,
    MediaResolver,
    MediaTooLarge,
    MediaURLError,
    TooManyMedia,
    UnsupportedMedia,
)
from prism.serving.protocol import parse_chat_request
from prism.serving.settings import EMBEDDED_MODEL_NAME, MIB, ServerSettings


def png(w: int = 8, h: int = 6, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def png_of(size: int) -> bytes:
    """A PNG padded to `size` bytes (whatever follows its end is not read): the resolver reads each image's header."""
    data = png()
    return data + b"\0" * (size - len(data))


def png_header(width: int, height: int) -> bytes:
    """A PNG claiming width x height whose pixel data is a few bytes: only its header can be read, decoding fails."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(*parts) -> list:
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": list(parts)}]}).messages


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def no_network(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"unexpected fetch of {request.url}")


# ------------------------------------------------------------------------------------------ settings
def test_settings_defaults_from_empty_env():
    s = ServerSettings.from_env({})
    assert s.model_dir is None and s.served_model_name == EMBEDDED_MODEL_NAME and s.media_root is None
    assert not s.allow_remote_media and s.remote_media_timeout_s == 10.0
    assert (s.max_media_bytes, s.max_media_per_request, s.max_request_bytes) == (20 * MIB, 16, 64 * MIB)
    assert (s.max_waiting_requests, s.preprocess_workers) == (256, 4)
    assert (s.max_video_pixels, s.max_image_pixels) == (2**27, 2**28)  # 16 images of 4096 x 4096


def test_settings_from_env(tmp_path):
    model = tmp_path / "Qwen3-VL-2B"
    model.mkdir()
    config = tmp_path / "engine.json"
    config.write_text("{}")
    media = tmp_path / "media"
    media.mkdir()
    link = tmp_path / "media-link"
    link.symlink_to(media)
    s = ServerSettings.from_env(
        {
            "PRISM_MODEL": str(model),
            "PRISM_CONFIG": str(config),
            "PRISM_MEDIA_ROOT": str(link),
            "PRISM_ALLOW_REMOTE_MEDIA": "1",
            "PRISM_MAX_MEDIA_BYTES": "1024",
            "PRISM_MAX_WAITING": "3",
            "PRISM_REMOTE_MEDIA_TIMEOUT_S": "2.5",
            "PRISM_PREPROCESS_WORKERS": "2",
            "PRISM_MAX_IMAGE_PIXELS": "1000000",
        }
    )
    assert s.model_dir == model and s.engine_config_path == config and s.served_model_name == "Qwen3-VL-2B"
    assert s.media_root == media.resolve()  # stored resolved: containment checks compare real paths
    assert s.allow_remote_media and s.max_media_bytes == 1024 and s.max_waiting_requests == 3
    assert s.remote_media_timeout_s == 2.5 and s.preprocess_workers == 2 and s.max_image_pixels == 1_000_000
    named = ServerSettings.from_env({"PRISM_MODEL": str(model), "PRISM_SERVED_MODEL_NAME": "qwen"})
    assert named.served_model_name == "qwen"


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("PRISM_MODEL", "/definitely/not/here"),
        ("PRISM_CONFIG", "/definitely/not/here.json"),
        ("PRISM_MEDIA_ROOT", "/definitely/not/here"),
        ("PRISM_MEDIA_ROOT", "relative/dir"),
        ("PRISM_ALLOW_REMOTE_MEDIA", "maybe"),
        ("PRISM_MAX_MEDIA_BYTES", "20MiB"),
        ("PRISM_MAX_MEDIA_BYTES", "0"),
        ("PRISM_MAX_MEDIA_PER_REQUEST", "-1"),
        ("PRISM_MAX_REQUEST_BYTES", "1.5"),
        ("PRISM_MAX_IMAGE_PIXELS", "0"),
        ("PRISM_MAX_IMAGE_PIXELS", "2**28"),
        ("PRISM_MAX_WAITING", "lots"),
        ("PRISM_PREPROCESS_WORKERS", "0"),
        ("PRISM_REMOTE_MEDIA_TIMEOUT_S", "inf"),
        ("PRISM_REMOTE_MEDIA_TIMEOUT_S", "-3"),
    ],
)
def test_settings_bad_values_name_the_variable(var, value):
    with pytest.raises(ValueError, match=var):
        ServerSettings.from_env({var: value})


def test_settings_direct_construction_validates(tmp_path):
    with pytest.raises(ValueError, match="max_media_per_request"):
        ServerSettings(max_media_per_request=0)
    with pytest.raises(ValueError, match="allow_remote_media"):
        ServerSettings(allow_remote_media="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="media_root"):
        ServerSettings(media_root=tmp_path / "missing")
    assert ServerSettings(model_dir=tmp_path / "m1").served_model_name == "m1"


# ------------------------------------------------------------------------------------------ data URLs
def test_data_url_ok_and_messages_shape():
    img = png()
    msgs = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, image_part(data_url(img))]},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            ],
        }
    ).messages
    out = MediaResolver(ServerSettings()).resolve_messages(msgs)
    assert out == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "image": img}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]


def test_data_url_with_line_breaks_and_any_image_type():
    img = png()
    wrapped = "data:image/webp;base64," + base64.encodebytes(img).decode()  # MIME-style, newlines every 76
    assert MediaResolver(ServerSettings()).resolve_url(wrapped) == img


@pytest.mark.parametrize(
    ("url", "text"),
    [
        ("data:image/png;base64,iVBO$$$=", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # bad padding
        ("data:image/png;base64,QQ==QQ==", "not valid base64"),  # data after padding
        ("data:image/png;base64,", "empty"),
        ("data:image/png;base64,abc", "not valid base64"),  # too short for one byte: not "empty"
        ("data:image/png;base64,!!!", "not valid base64"),
        ("data:text/plain;base64,QUJD", "image/*"),
        ("data:;base64,QUJD", "image/*"),
        ("data:image/png,%89PNG", "base64"),
        ("data:image/png;base64", "no ','"),
        ("ftp://example.com/a.png", "unsupported media URL"),
        ("relative/a.png", "unsupported media URL"),
    ],
)
def test_bad_data_urls(url, text):
    with pytest.raises(InvalidMediaURL, match=text) as info:
        MediaResolver(ServerSettings()).resolve_url(url, param="messages[0].content[0].image_url.url")
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].image_url.url"


def test_data_url_too_large_is_refused_before_decoding():
    s = ServerSettings(max_media_bytes=1000)
    ok = base64.b64encode(b"x" * 1000).decode()
    assert MediaResolver(s).resolve_url(f"data:image/png;base64,{ok}") == b"x" * 1000
    big = base64.b64encode(b"x" * 1001).decode()
    with pytest.raises(MediaTooLarge, match="1001 bytes") as info:
        MediaResolver(s).resolve_url(f"data:image/png;base64,{big}")
    assert info.value.status == 413
    # A too-long payload that is not even base64 is refused for its size: nothing was decoded.
    with pytest.raises(MediaTooLarge):
        MediaResolver(s).resolve_url("data:image/png;base64," + "$" * 4000)


def test_request_total_media_budget():
    s = ServerSettings(max_media_bytes=600, max_request_bytes=1000)
    url = data_url(png_of(600))
    MediaResolver(s).resolve_messages(user(image_part(url)))
    with pytest.raises(MediaTooLarge, match="max_request_bytes"):
        MediaResolver(s).resolve_messages(user(image_part(url), image_part(url)))


def test_repeated_data_url_skips_the_decode_but_not_the_budget():
    """The second time a data URL arrives its payload comes from the decoded-URL cache (same bytes); the
    request's media budget still counts it."""
    s = ServerSettings(max_media_bytes=600, max_request_bytes=1000)
    resolver = MediaResolver(s)
    url = data_url(png_of(600))
    first = resolver.resolve_messages(user(image_part(url)))
    again = resolver.resolve_messages(user(image_part(url)))
    assert again == first and resolver._decoded.hits == 1
    with pytest.raises(MediaTooLarge, match="max_request_bytes"):
        resolver.resolve_messages(user(image_part(url), image_part(url)))


def test_decoded_url_cache_never_trusts_its_sampled_key():
    """Two URLs of one length that agree on every sampled window are two entries' worth of content: the
    second is a miss (decoded afresh), never the first one's payload."""
    cache = DecodedDataURLs(10 * MIB)
    pad = "A" * 200
    a = f"data:image/png;base64,{pad}QUFB{pad}{pad}"
    b = f"data:image/png;base64,{pad}QkJC{pad}{pad}"
    assert len(a) == len(b) and a != b
    cache.put(a, b"AAA")
    assert cache.get(a) == b"AAA"
    assert cache.get(b) is None
    cache.put(b, b"BBB")
    assert cache.get(b) == b"BBB" and cache.get(a) is None  # one slot per sampled key; a was replaced


def test_decoded_url_cache_is_bounded_lru():
    cache = DecodedDataURLs(3 * (10 + 10))
    urls = [f"data:{i:05d}" for i in range(4)]  # 10 characters each
    for u in urls[:3]:
        cache.put(u, b"p" * 10)
    assert cache.get(urls[0]) == b"p" * 10  # now the most recent
    cache.put(urls[3], b"p" * 10)
    assert cache.get(urls[1]) is None and cache.get(urls[0]) is not None and cache.nbytes <= cache.max_bytes
    cache.put("data:" + "x" * 100, b"too big for the whole cache")
    assert cache.nbytes <= cache.max_bytes
    assert DecodedDataURLs(0).get("data:") is None
    with pytest.raises(ValueError):
        DecodedDataURLs(-1)


# ------------------------------------------------------------------------------------------ local files
@pytest.fixture
def media(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    img = png(seed=1)
    (root / "cat.png").write_bytes(img)
    (outside / "secret.png").write_bytes(b"secret")
    return root, outside, img


def test_file_under_root_ok(media):
    root, _, img = media
    r = MediaResolver(ServerSettings(media_root=root))
    assert r.resolve_url(f"file://{root}/cat.png") == img
    assert r.resolve_url(f"file://localhost{root}/cat.png") == img
    assert r.resolve_url(str(root / "cat.png")) == img
    (root / "a b.png").write_bytes(img)
    assert r.resolve_url(f"file://{root}/a%20b.png") == img
    (root / "link.png").symlink_to(root / "cat.png")  # a symlink that stays inside is fine
    assert r.resolve_url(str(root / "link.png")) == img


def test_file_outside_root_refused(media):
    root, outside, _ = media
    r = MediaResolver(ServerSettings(media_root=root))
    for url in (
        f"file://{outside}/secret.png",
        str(outside / "secret.png"),
        f"{root}/../outside/secret.png",
        f"{outside}/does-not-exist.png",
        "/etc/passwd",
        f"file://{root}x/a.png",
    ):
        with pytest.raises(ForbiddenMedia, match="outside the media root") as info:
            r.resolve_url(url)
        assert info.value.status == 403


def test_symlink_escape_refused(media):
    root, outside, _ = media
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "dir-link").symlink_to(outside)
    r = MediaResolver(ServerSettings(media_root=root))
    for path in (root / "escape.png", root / "dir-link" / "secret.png"):
        with pytest.raises(ForbiddenMedia):
            r.resolve_url(str(path))


def test_root_unset_refuses_local_files(media):
    root, _, _ = media
    r = MediaResolver(ServerSettings())
    with pytest.raises(ForbiddenMedia, match="disabled"):
        r.resolve_url(str(root / "cat.png"))
    with pytest.raises(ForbiddenMedia, match="disabled"):
        r.resolve_url(f"file://{root}/cat.png")


def test_local_file_errors(media):
    root, _, _ = media
    r = MediaResolver(ServerSettings(media_root=root, max_media_bytes=100))
    with pytest.raises(MediaNotFound) as info:
        r.resolve_url(f"{root}/missing.png")
    assert info.value.status == 400
    with pytest.raises(MediaTooLarge):
        r.resolve_url(f"{root}/cat.png")  # the PNG is larger than 100 bytes
    (root / "sub").mkdir()
    with pytest.raises(InvalidMediaURL, match="not a regular file"):
        r.resolve_url(f"{root}/sub")
    os.mkfifo(root / "fifo")  # opening a FIFO must not block the worker
    t0 = time.monotonic()
    with pytest.raises(InvalidMediaURL, match="not a regular file"):
        r.resolve_url(f"{root}/fifo")
    assert time.monotonic() - t0 < 2
    (root / "empty.png").write_bytes(b"")
    with pytest.raises(InvalidMediaURL, match="empty"):
        r.resolve_url(f"{root}/empty.png")
    with pytest.raises(InvalidMediaURL, match="file:///absolute"):
        r.resolve_url("file://otherhost/etc/passwd")


# ------------------------------------------------------------------------------------------ remote
def test_http_disabled_refused_without_fetching():
    r = MediaResolver(ServerSettings(), transport=httpx.MockTransport(no_network))
    for url in ("http://example.com/a.png", "HTTPS://example.com/a.png"):
        with pytest.raises(ForbiddenMedia, match="PRISM_ALLOW_REMOTE_MEDIA") as info:
            r.resolve_url(url)
        assert info.value.status == 403


def remote(handler, **settings) -> MediaResolver:
    return MediaResolver(
        ServerSettings(allow_remote_media=True, **settings), transport=httpx.MockTransport(handler)
    )


def test_http_via_mock_transport():
    img = png(seed=2)
    seen = []

    def handler(request):
        seen.append(str(request.url))
        if request.url.path == "/old.png":
            return httpx.Response(302, headers={"location": "/cat.png"})
        if request.url.path == "/cat.png":
            return httpx.Response(200, content=img, headers={"content-type": "image/png"})
        return httpx.Response(404)

    r = remote(handler)
    assert r.resolve_url("https://media.test/cat.png") == img
    assert r.resolve_url("http://media.test/old.png") == img  # one redirect followed
    with pytest.raises(MediaFetchError, match="HTTP 404") as info:
        r.resolve_url("https://media.test/nope.png", param="p")
    assert info.value.status == 400 and info.value.param == "p"
    assert seen[:3] == [
        "https://media.test/cat.png",
        "http://media.test/old.png",
        "http://media.test/cat.png",
    ]


def test_http_redirect_limit():
    def loop(request):
        n = int(request.url.params.get("n", "0"))
        return httpx.Response(302, headers={"location": f"/r?n={n + 1}"})

    with pytest.raises(MediaFetchError, match="more than 2 redirects"):
        remote(loop, remote_media_max_redirects=2).resolve_url("http://media.test/r")
    with pytest.raises(MediaFetchError, match="HTTP 302"):
        remote(loop, remote_media_max_redirects=0).resolve_url("http://media.test/r")


def test_http_too_large_declared_and_streamed():
    declared = remote(lambda req: httpx.Response(200, content=b"z" * 2000), max_media_bytes=1000)
    with pytest.raises(MediaTooLarge, match="2000 bytes"):
        declared.resolve_url("http://media.test/big")

    produced = []

    def endless():  # no content-length: the cap must stop reading, not the producer
        for _ in range(10_000):
            produced.append(1)
            yield b"z" * 256

    streamed = remote(lambda req: httpx.Response(200, content=endless()), max_media_bytes=1000)
    with pytest.raises(MediaTooLarge, match="more than 1000 bytes") as info:
        streamed.resolve_url("http://media.test/endless")
    assert info.value.status == 413 and len(produced) <= 5


def test_http_timeout_and_connection_error():
    def slow(request):
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(MediaFetchTimeout, match="longer than 0.5 s"):
        remote(slow, remote_media_timeout_s=0.5).resolve_url("http://media.test/slow")

    def refused(request):
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(MediaFetchError, match="ConnectError"):
        remote(refused).resolve_url("http://media.test/x")


class _Handler(BaseHTTPRequestHandler):
    payload = b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow":
            time.sleep(1.5)  # longer than the client's 0.3 s timeout
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def local_server():
    _Handler.payload = png(seed=3)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Handler.payload
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_http_real_local_server(local_server):
    base, img = local_server
    r = MediaResolver(ServerSettings(allow_remote_media=True, remote_media_timeout_s=0.3))
    assert r.resolve_url(f"{base}/cat.png") == img
    t0 = time.monotonic()
    with pytest.raises(MediaFetchTimeout):
        r.resolve_url(f"{base}/slow")
    assert time.monotonic() - t0 < 1.4


# ------------------------------------------------------------------------------------------ counts, videos
def test_too_many_items_refused_before_any_fetch():
    s = ServerSettings(max_media_per_request=2, allow_remote_media=True)
    r = MediaResolver(s, transport=httpx.MockTransport(no_network))
    parts = [image_part("http://media.test/a.png")] * 2 + [
        {"type": "video", "video": {"frames": ["http://x/f"], "fps": 1}}
    ]
    with pytest.raises(TooManyMedia, match="at most 2") as info:
        r.resolve_messages(user(*parts))
    assert info.value.status == 400 and info.value.param == "messages"
    with pytest.raises(TooManyMedia, match="at most 3 frames"):
        MediaResolver(
            ServerSettings(max_video_frames=3), transport=httpx.MockTransport(no_network)
        ).resolve_messages(user({"type": "video", "video": {"frames": ["http://x/f"] * 4, "fps": 1}}))


def test_video_url_is_unsupported():
    with pytest.raises(UnsupportedMedia, match="video_url is not supported") as info:
        MediaResolver(ServerSettings()).resolve_messages(
            user({"type": "video_url", "video_url": {"url": "http://x/v.mp4"}})
        )
    assert info.value.param == "messages[0].content[0]"


def test_video_frames_are_handed_over_encoded_with_a_pixel_budget():
    frames = [data_url(png(16, 12, seed=i)) for i in range(4)]
    part = {"type": "video", "video": {"frames": frames, "fps": 2.0}}
    out = MediaResolver(ServerSettings()).resolve_messages(user({"type": "text", "text": "v"}, part))
    video = out[0]["content"][1]
    assert video == {"type": "video", "video": [png(16, 12, seed=i) for i in range(4)], "fps": 2.0}
    with pytest.raises(MediaTooLarge, match="the frames this request's videos sample announce 768 pixels in all; "
                                            "the limit is max_video_pixels=576") as info:
        MediaResolver(ServerSettings(max_video_pixels=16 * 12 * 3)).resolve_messages(user(part))
    assert info.value.param == "messages[0].content[0].video.frames[3]"
    # The engine's lower budget (the server state passes the lower of the two) is the one refused at, and named.
    with pytest.raises(MediaTooLarge, match=f"max_video_pixels={16 * 12 * 3}, crossed at video 0's frame 3") as info:
        MediaResolver(ServerSettings(), max_video_pixels=16 * 12 * 3).resolve_messages(user(part))
    assert info.value.param == "messages[0].content[0].video.frames[3]"
    bad = {"type": "video", "video": {"frames": [frames[0], data_url(b"not an image")], "fps": 1.0}}
    with pytest.raises(InvalidMediaData, match="not a decodable image") as info:
        MediaResolver(ServerSettings()).resolve_messages(user(bad))
    assert info.value.param == "messages[0].content[0].video.frames[1]"


@pytest.mark.parametrize("frames, fps, words", [
    (4, 1e-300, r"must stay below 2\*\*49 seconds"),  # its timestamps past what a float tells apart
    (4, 5e-324, "last longer than a float holds"),  # its frame count past the floats
    (1, 2.0, "at least 2 are needed"),  # fewer frames than a temporal patch
])
def test_a_video_the_engines_sampling_refuses_is_refused_before_any_frame_is_fetched(frames, fps, words):
    remote = MediaResolver(ServerSettings(allow_remote_media=True), transport=httpx.MockTransport(no_network))
    fine = {"type": "video", "video": {"frames": ["http://x/f"] * 4, "fps": 2.0}}
    refused = {"type": "video", "video": {"frames": ["http://x/f"] * frames, "fps": fps}}
    with pytest.raises(InvalidVideo, match=words) as info:
        remote.resolve_messages(user(fine, refused))  # the first video's frames not fetched either
    assert info.value.status == 400 and info.value.param == "messages[0].content[1].video"


def test_the_frames_of_a_request_past_its_budget_are_all_judged_before_any_is_decoded(monkeypatch):
    """The second video's frame crosses max_video_pixels: the first video's frames are not decoded either, and the
    413 names the request's total and the frame that crosses it."""
    frames = [data_url(png(16, 12, seed=i)) for i in range(3)]
    parts = [{"type": "video", "video": {"frames": frames[:2], "fps": 2.0}},
             {"type": "video", "video": {"frames": frames, "fps": 2.0}}]
    resolver = MediaResolver(ServerSettings(max_video_pixels=16 * 12 * 4))
    decoded, load = [], ImageFile.ImageFile.load  # every pixel load of an opened image
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or load(self))
    with pytest.raises(MediaTooLarge, match=r"announce 960 pixels in all; the limit is max_video_pixels=768, "
                                            r"crossed at video 1's frame 2 \(16x12\)") as info:
        resolver.resolve_messages(user(*parts))
    assert info.value.param == "messages[0].content[1].video.frames[2]"
    assert not decoded and resolver._decoded.nbytes == 0


def test_the_video_budget_counts_the_frames_sampled_and_every_frame_sent_is_judged(monkeypatch):
    """30 fps: 16 frames sent, 4 sampled (Qwen3-VL's 2 fps, at least min_frames=4). The budget takes the 4 (a 413
    saying it counts the sampled frames past them); a frame not sampled is still read from its header, and one that
    is not an image is a 400 naming it. Nothing is decoded here."""
    sent = [data_url(png(16, 12, seed=i)) for i in range(16)]
    part = {"type": "video", "video": {"frames": sent, "fps": 30.0}}
    decoded, load = [], ImageFile.ImageFile.load  # every pixel load of an opened image
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or load(self))
    out = MediaResolver(ServerSettings(max_video_pixels=16 * 12 * 4)).resolve_messages(user(part))
    assert len(out[0]["content"][0]["video"]) == 16 and not decoded
    with pytest.raises(MediaTooLarge, match=r"the frames this request's videos sample announce 768 pixels in all; the "
                                            r"limit is max_video_pixels=767, crossed at video 0's frame 15") as info:
        MediaResolver(ServerSettings(max_video_pixels=16 * 12 * 4 - 1)).resolve_messages(user(part))
    assert info.value.param == "messages[0].content[0].video.frames[15]"
    unsampled = {"type": "video", "video": {"frames": [*sent[:3], data_url(b"not an image"), *sent[4:]], "fps": 30.0}}
    with pytest.raises(InvalidMediaData, match="not a decodable image") as info:
        MediaResolver(ServerSettings()).resolve_messages(user(unsampled))
    assert info.value.param == "messages[0].content[0].video.frames[3]" and not decoded


def test_images_past_max_image_pixels_are_refused_from_their_headers_and_cache_nothing():
    """A 413 naming the limit, the request's total and the image part that crosses it, read from the headers once
    every source is read (nothing decoded: the header of a PNG whose pixel data is missing is enough); the data URLs
    of a refused request stay out of the decoded-URL cache. An image named by its uuid alone counts nothing."""
    budget = 16 * 12 * 2
    urls = [data_url(png(16, 12, seed=i)) for i in range(3)]
    resolver = MediaResolver(ServerSettings(max_image_pixels=budget))
    with pytest.raises(MediaTooLarge, match=r"576 pixels in all; the limit is max_image_pixels=384, crossed at image 2 "
                                            r"\(16x12\): refused before decoding any") as info:
        resolver.resolve_messages(user(image_part(urls[0]), {"type": "text", "text": "and"},
                                       image_part(urls[1]), image_part(urls[2])))
    assert info.value.status == 413 and info.value.param == "messages[0].content[3].image_url.url"
    assert resolver._decoded.nbytes == 0 and resolver._decoded.misses == 3
    named = {"type": "image_url", "image_url": None, "uuid": "known"}
    out = resolver.resolve_messages(user(image_part(urls[0]), named, image_part(urls[1])))
    assert [p["image"] for p in out[0]["content"]][1] is None and resolver._decoded.nbytes > 0
    header_only = png_header(4000, 3000)
    with pytest.raises(MediaTooLarge, match="12000000 pixels in all"):
        MediaResolver(ServerSettings(max_image_pixels=10**7)).resolve_messages(user(image_part(data_url(header_only))))
    with pytest.raises(InvalidMediaData, match="not a decodable image") as info:
        resolver.resolve_messages(user(image_part(urls[0]), image_part(data_url(b"not an image"))))
    assert info.value.param == "messages[0].content[1].image_url.url"


def test_the_resolver_refuses_at_the_engines_budget_where_it_is_lower():
    """The server passes the lower of its and its engine's max_image_pixels, so that the engine never refuses a
    request's pixels after the resolver cached its data URLs."""
    urls = [data_url(png(16, 12, seed=i)) for i in range(2)]
    assert MediaResolver(ServerSettings(), max_image_pixels=16 * 12).max_image_pixels == 192
    with pytest.raises(MediaTooLarge, match="max_image_pixels=192"):
        MediaResolver(ServerSettings(), max_image_pixels=16 * 12).resolve_messages(
            user(image_part(urls[0]), image_part(urls[1])))


def test_errors_are_value_errors_with_status():
    for cls, status in (
        (InvalidMediaURL, 400),
        (ForbiddenMedia, 403),
        (MediaTooLarge, 413),
        (TooManyMedia, 400),
        (MediaFetchTimeout, 400),
        (UnsupportedMedia, 400),
        (InvalidMediaData, 400),
    ):
        err = cls("msg", param="x")
        assert isinstance(err, MediaURLError) and isinstance(err, ValueError) and err.status == status
        assert str(err) == "x: msg"


def test_resolved_messages_feed_prepare_chat():
    """End to end on the tiny checkpoint: the resolver's output is what InputProcessor.prepare_chat takes."""
    from prism.engine.inputs import InputProcessor
    from prism.testing.checkpoints import ensure_tiny_checkpoint

    proc = InputProcessor(ensure_tiny_checkpoint())
    frames = [data_url(png(32, 32, seed=10 + i)) for i in range(4)]
    msgs = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "sys"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "compare"},
                        image_part(data_url(png(32, 32, seed=5))),
                        {"type": "video", "video": {"frames": frames, "fps": 2.0}},
                    ],
                },
            ],
        }
    ).messages
    prompt = proc.prepare_chat(MediaResolver(ServerSettings()).resolve_messages(msgs))
    assert [m.kind for m in prompt.media] == ["image", "video"]
    assert prompt.num_media_tokens > 0 and len(prompt.token_ids) > prompt.num_media_tokens
