"""The refusals of a request's media at the server (`media_urls.MediaResolver`, `video_frames`): each a `ValueError`
whose `status` is the HTTP status it answers and whose `param` names the request's field. Owns no invariant."""

from __future__ import annotations


class MediaURLError(ValueError):
    """A media URL of a request cannot be served; `status` is the HTTP status, `param` the field."""

    status = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.message = message
        self.param = param


class InvalidMediaURL(MediaURLError):
    """Malformed URL, unsupported scheme, non-image data URL, bad base64, not a regular file."""


class MediaNotFound(MediaURLError):
    """A local file (inside media_root) does not exist."""


class ForbiddenMedia(MediaURLError):
    """The source is not allowed here: local files outside / without media_root, remote media switched off."""

    status = 403


class MediaTooLarge(MediaURLError):
    """An item exceeds max_media_bytes, the request's media exceed max_request_bytes, its images max_image_pixels or
    its video frames max_video_pixels."""

    status = 413


class TooManyMedia(MediaURLError):
    """More than max_media_per_request items, or more than max_video_frames frames in one video."""


class UnsupportedMedia(MediaURLError):
    """A media kind this server cannot take (video_url: no video decoder)."""


class MediaFetchError(MediaURLError):
    """A remote fetch failed: HTTP error status, connection error, too many redirects."""


class MediaFetchTimeout(MediaFetchError):
    """A remote fetch did not finish within remote_media_timeout_s."""


class InvalidMediaData(MediaURLError):
    """An image's or a video frame's bytes are not a decodable image."""


class InvalidVideo(MediaURLError):
    """A video whose frame count and rate the engine's sampling refuses (a rate whose timestamps leave what a float
    tells apart, fewer sampled frames than a temporal patch): known before any of its frames is fetched."""
