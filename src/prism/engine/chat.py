"""Chat messages -> prompt text plus the media they carry, in the order their placeholders appear.

Owns: the request-side shape of a conversation (and of a raw prompt's media lists), how it becomes text,
and the tokenizer-side files that shape text (chat template, named special tokens, eos ids).
- The chat template is read from the checkpoint (`chat_template.jinja`, else `chat_template.json`, else
  `chat_template` in `tokenizer_config.json`) and rendered with jinja2 the way HF transformers renders it:
  an immutable sandbox, `trim_blocks` + `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter
  that does not HTML-escape, `raise_exception` / `strftime_now` globals, `{% generation %}` blocks rendered
  as their body, and the tokenizer's named special tokens (bos_token, eos_token, ...) as variables.
- Message parts: `{"type": "text", "text"}`, `{"type": "image", "image": bytes | PIL | uint8 HxWx3}`,
  `{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}` (data URLs only: remote URLs
  and paths are refused here) and `{"type": "video", "video": frames, "fps": source frame rate}` (or the server's
  `{"type": "video", "video": {"frames": frames, "fps": rate}}`; frames as encoded images, PIL images or arrays) with an
  optional `num_frames` (sample exactly that many frames instead of the processor's fps). An image part may
  carry a `uuid` (vLLM's convention): the client's name for that image. Sent once with its data, the image can
  then be named by its uuid alone (`"image": None` / `"image_url": None`), which skips decoding and hashing it.
  The template sees media parts as bare `{"type": "image"}` / `{"type": "video"}` (payloads are not text).
- Media are collected in message order, part order (what HF's processor does); images and videos are
  numbered separately, matching how placeholders are expanded.

Every malformed message raises `InputError` (a ValueError) naming the message and part.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image

from ..media.errors import ImageTooLargeError


class InputError(ValueError):
    """A request (messages, prompt, media list) is malformed or inconsistent."""


class ChatTemplateError(InputError):
    """The checkpoint has no chat template, or the template rejected the messages."""


ImageData = bytes | bytearray | memoryview | Image.Image | np.ndarray


@dataclass(frozen=True)
class ImageInput:
    """One image as given: encoded file bytes, a PIL image or a uint8 [H, W, 3] array; or only a `uuid`, the
    client's name for an image it sent with that uuid before (the server then skips decoding and hashing)."""

    data: ImageData | None
    uuid: str | None = None


@dataclass(frozen=True)
class VideoInput:
    """Decoded frames (PIL images or uint8 [H, W, 3] arrays, or one uint8 [F, H, W, 3] array) recorded at
    `fps` frames per second. `num_frames` overrides the processor's sampling fps with a frame count."""

    frames: Sequence[Image.Image | np.ndarray] | np.ndarray
    fps: float
    num_frames: int | None = None


MediaInput = ImageInput | VideoInput

# Named special tokens HF exposes to templates (`special_tokens_map` of transformers 5.x).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL)


# ------------------------------------------------------------------------------------------ files
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc


def load_json_object(path: Path, required: bool) -> dict[str, Any]:
    """A checkpoint JSON file holding an object; {} when it is absent and not required."""
    if not path.is_file():
        if required:
            raise InputError(f"checkpoint file missing: {path}")
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise InputError(f"{path} must hold a JSON object")
    return data


def read_eos_token_ids(
    model_dir: str | Path, tokenizer_config: Mapping[str, Any], tokenizer: Any
) -> tuple[int, ...]:
    """generation_config.json's eos ids, then the tokenizer's eos_token, deduplicated in that order."""
    ids: list[int] = []
    gen = load_json_object(Path(model_dir) / "generation_config.json", required=False).get("eos_token_id")
    for value in gen if isinstance(gen, list) else [gen]:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.append(value)
        elif value is not None:
            raise InputError(f"generation_config.json eos_token_id has a non-int entry {value!r}")
    eos = special_token_strings(tokenizer_config).get("eos_token")
    if eos is not None:
        tid = tokenizer.token_to_id(eos)
        if tid is None:
            raise InputError(f"tokenizer_config eos_token {eos!r} is not in the vocabulary")
        ids.append(tid)
    return tuple(dict.fromkeys(ids))


# ------------------------------------------------------------------------------------------ template


def _template_from_value(value: Any, where: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # HF's named-template list: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ChatTemplateError(f"{where}: chat_template must be a string or a list with a 'default' entry")


def load_chat_template(model_dir: str | Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The checkpoint's chat template source, or None when it has none."""
    root = Path(model_dir)
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = root / "chat_template.json"
    if json_file.is_file():
        data = load_json_object(json_file, required=True)
        if "chat_template" not in data:
            raise ChatTemplateError(f"{json_file} has no 'chat_template' key")
        return _template_from_value(data["chat_template"], json_file)
    if tokenizer_config.get("chat_template") is not None:
        return _template_from_value(tokenizer_config["chat_template"], root / "tokenizer_config.json")
    return None


def special_token_strings(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as strings (tokenizer_config stores a string or an AddedToken dict)."""
    out: dict[str, str] = {}
    for name in _NAMED_SPECIAL_TOKENS:
        value = tokenizer_config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; `render` is thread-safe (jinja templates hold no render state)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._special = dict(special_tokens or {})

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        extra = dict(extra or {})
        clash = _RESERVED_TEMPLATE_VARS & extra.keys()
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(clash)}")
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._special, **extra},
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
            raise ChatTemplateError(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc


# ------------------------------------------------------------------------------------------ parts
def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; anything else (http, file paths) is refused."""
    if not isinstance(url, str):
        raise InputError(f"image_url.url must be a string, got {type(url).__name__}")
    match = _DATA_URL.fullmatch(url.strip())
    if match is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise InputError(f"only data: URLs are accepted for images here, got {shown!r}")
    mime = match["mime"].strip().lower()
    if mime and not mime.startswith("image/"):
        raise InputError(f"data URL media type must be image/*, got {mime!r}")
    if "base64" not in [p.strip().lower() for p in match["params"].split(";") if p]:
        raise InputError("image data URLs must be base64-encoded (';base64,')")
    payload = re.sub(r"\s+", "", match["data"])
    if len(payload) // 4 * 3 > max_bytes:  # refuse before allocating the decoded bytes
        raise ImageTooLargeError(
            f"data URL holds about {len(payload) // 4 * 3} bytes; the limit is {max_bytes}"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"image data URL is not valid base64: {exc}") from exc
    if not data:
        raise InputError("image data URL is empty")
    return data


def _check_keys(part: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(part) - allowed)
    if unknown:
        raise InputError(f"{where}: unknown keys {unknown} (allowed: {sorted(allowed)})")


_IMAGE_KEYS = frozenset({"type", "image", "uuid"})
_IMAGE_URL_KEYS = frozenset({"type", "image_url", "uuid"})
MAX_UUID_CHARS = 256


def _image_uuid(part: Mapping[str, Any], where: str) -> str | None:
    uuid = part.get("uuid")
    if uuid is not None and (not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID_CHARS):
        raise InputError(f"{where}: uuid must be a non-empty string of at most {MAX_UUID_CHARS} characters")
    return uuid
_VIDEO_KEYS = frozenset({"type", "video", "fps", "num_frames"})
_TEXT_KEYS = frozenset({"type", "text"})


def _image_url_part(part: Mapping[str, Any], where: str, max_bytes: int) -> ImageInput:
    _check_keys(part, _IMAGE_URL_KEYS, where)
    spec = part.get("image_url")
    uuid = _image_uuid(part, where)
    if spec is None and uuid is not None:
        return ImageInput(None, uuid)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - {"url", "detail"})
        if unknown:
            raise InputError(f"{where}: unknown image_url keys {unknown}")
        if spec.get("detail", "auto") != "auto":
            raise InputError(f"{where}: image_url.detail={spec['detail']!r} is not supported (only 'auto')")
        url = spec.get("url")
    else:
        url = spec
    if url is None:
        raise InputError(f"{where}: image_url part has no url")
    return ImageInput(decode_data_url(url, max_bytes), uuid)


def _video_part(part: Mapping[str, Any], where: str) -> VideoInput:
    _check_keys(part, _VIDEO_KEYS, where)
    frames = part.get("video")
    if isinstance(frames, Mapping):  # the server's form, {"video": {"frames": [...], "fps": ...}}, taken too
        if set(frames) - {"frames", "fps"} or "fps" in part:
            raise InputError(f"{where}: a video given as {{'frames': [...], 'fps': ...}} takes no other keys")
        part = {**part, "fps": frames.get("fps")}
        frames = frames.get("frames")
    if frames is None:
        raise InputError(f"{where}: video part has no 'video' frames")
    if isinstance(frames, (str, bytes, bytearray, memoryview)):
        raise InputError(f"{where}: video must be a list of frames (images as bytes, PIL images or uint8 arrays) "
                         "or a uint8 array, not one encoded file")
    fps = part.get("fps")
    if fps is None:
        raise InputError(f"{where}: video part needs 'fps' (the frame rate of the given frames)")
    return VideoInput(frames=frames, fps=fps, num_frames=part.get("num_frames"))


def parse_messages(
    messages: Sequence[Mapping[str, Any]], *, max_image_bytes: int
) -> tuple[list[dict[str, Any]], list[MediaInput]]:
    """Validate messages; return (template-ready messages, media in placeholder order)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise InputError("messages is empty")
    rendered: list[dict[str, Any]] = []
    media: list[MediaInput] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InputError(f"message {i} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InputError(f"message {i} needs a non-empty string 'role'")
        content = message.get("content")
        out = dict(message)
        if content is None or isinstance(content, str):
            rendered.append(out)
            continue
        if isinstance(content, Mapping) or not isinstance(content, Sequence):
            raise InputError(
                f"message {i}: content must be a string or a list of parts, got {type(content).__name__}"
            )
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = f"message {i} part {j}"
            if not isinstance(part, Mapping):
                raise InputError(f"{where} must be a dict, got {type(part).__name__}")
            kind = part.get("type")
            if kind == "text":
                _check_keys(part, _TEXT_KEYS, where)
                if not isinstance(part.get("text"), str):
                    raise InputError(f"{where}: text part needs a string 'text'")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                _check_keys(part, _IMAGE_KEYS, where)
                uuid = _image_uuid(part, where)
                if part.get("image") is None and uuid is None:
                    raise InputError(f"{where}: image part has no 'image' data (nor a 'uuid' of an image sent before)")
                media.append(ImageInput(part.get("image"), uuid))
                parts.append({"type": "image"})
            elif kind == "image_url":
                media.append(_image_url_part(part, where, max_image_bytes))
                parts.append({"type": "image"})
            elif kind == "video":
                media.append(_video_part(part, where))
                parts.append({"type": "video"})
            else:
                raise InputError(
                    f"{where}: unknown part type {kind!r} (expected text, image, image_url or video)"
                )
        out["content"] = parts
        rendered.append(out)
    return rendered, media


def coerce_media_lists(images: Any, videos: Any) -> tuple[list[ImageInput], list[VideoInput]]:
    """A raw prompt's media: images as bytes / PIL / arrays (or ImageInput), videos as VideoInput or
    {"video": frames, "fps": ..., "num_frames"?: ...}."""
    for name, value in (("images", images), ("videos", videos)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise InputError(f"{name} must be a list, got {type(value).__name__}")
    image_inputs = []
    for i, im in enumerate(images):
        image = im if isinstance(im, ImageInput) else ImageInput(im)
        if image.data is None and image.uuid is None:
            raise InputError(f"image {i} has no data (nor a uuid of an image sent before)")
        image_inputs.append(image)
    video_inputs = []
    for j, v in enumerate(videos):
        if isinstance(v, Mapping):
            if set(v) - {"video", "fps", "num_frames"} or "video" not in v or "fps" not in v:
                raise InputError(f"video {j} must have 'video' and 'fps' (and optionally 'num_frames')")
            v = VideoInput(v["video"], v["fps"], v.get("num_frames"))
        if not isinstance(v, VideoInput):
            raise InputError(f"video {j} must be a VideoInput or a dict, got {type(v).__name__}")
        video_inputs.append(v)
    return image_inputs, video_inputs
