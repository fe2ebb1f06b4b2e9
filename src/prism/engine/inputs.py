"""A request (chat messages or a raw prompt, with images / videos) -> everything the engine needs.

Owns: the prepared form of a prompt, `PreparedPrompt`: expanded token ids, modality ids, M-RoPE positions
and rope delta, the preprocessed media in prompt order with their content digests, and the prefix-cache
content (`kv_content()`: one `MediaSpan(start, length, digest)` per pad run). Here: the chat template, tokenizing
(a text that cannot fit the limit refused before it is tokenized whole), the placeholder counts checked against the
media given, expansion, and positions, computed from the expanded prompt before any cache lookup can happen. The
media themselves, their digests (the identity rules) and the preprocessing cache: `media_preparation.py`.

`InputProcessor` holds no mutable state after construction but the image uuids (`image_names`); its methods may
run on worker threads concurrently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from ..media.cache import PreprocessCache
from ..media.config import ImageProcessorConfig, VideoProcessorConfig
from ..media.image import DEFAULT_LIMITS, DecodeLimits
from ..media.pixel_budget import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_PIXELS
from ..media.placeholders import SpecialTokens, VideoPlaceholder, expand_placeholders
from ..media.prepare import PreparedImage
from ..model.config import Qwen3VLConfig
from ..model.mrope import mrope_positions_from_spans
from .chat import (
    ChatTemplate,
    ChatTemplateError,
    ImageInput,
    InputError,
    MediaInput,
    VideoInput,
    coerce_media_lists,
    load_chat_template,
    load_json_object,
    parse_messages,
    read_eos_token_ids,
    special_token_strings,
)
from .detokenize import DetokenizeError, byte_level_vocab
from .image_names import ImageNameConflict, ImageNames
from .media_preparation import MediaMemo, MediaPreparer, place_media
from .prompt import PreparedMedia, PreparedPrompt

__all__ = [
    "ChatTemplateError",
    "ImageInput",
    "InputError",
    "InputProcessor",
    "PreparedMedia",
    "PreparedPrompt",
    "PromptTooLongError",
    "VideoInput",
]


class PromptTooLongError(InputError):
    """The expanded prompt (text + media tokens) exceeds the processor's max_prompt_tokens."""


# A long text's head is tokenized first to refuse it early (`InputProcessor._refuse_texts_past_the_limit`): this many
# characters a token of the limit, and a margin of tokens for the word the cut falls in.
_HEAD_CHARS_PER_TOKEN = 8
_HEAD_MARGIN = 16


# ------------------------------------------------------------------------------------------ processor
def read_processor_configs(root: Path) -> tuple[ImageProcessorConfig, VideoProcessorConfig]:
    """A checkpoint's image and video processor settings (`preprocessor_config.json`; `video_preprocessor_config.json`,
    or Qwen3-VL's video defaults without one); a bad setting is a `MediaConfigError` naming its file and value. The
    engine reads them before it loads the model, so that a bad one fails its start at once."""
    image_config = ImageProcessorConfig.from_json_file(root / "preprocessor_config.json")
    video_file = root / "video_preprocessor_config.json"
    video_config = VideoProcessorConfig.from_json_file(video_file) if video_file.is_file() else VideoProcessorConfig()
    return image_config, video_config


class InputProcessor:
    """Turns requests into `PreparedPrompt`s for one checkpoint directory.

    model_id namespaces media digests and cache keys (default: the resolved checkpoint path). `cache` is a
    shared `PreprocessCache` (offline, in-process and HTTP paths may share one); `cache_bytes` instead
    makes a private one of that size (0 or None: no cache). `limits` bounds decoding, `max_image_pixels` the pixels of
    a prompt's images in all and `max_video_pixels` those of the frames its videos sample (`media.pixel_budget`:
    judged from their headers before any is decoded).
    `max_prompt_tokens` (optional) refuses longer expanded prompts with `PromptTooLongError` (`prompt_limit_reason`:
    what the limit comes from, for its message). `max_text_tokens` (default: `max_prompt_tokens`) refuses, before
    tokenizing, texts too long to tokenize within that many tokens (`max_prompt_chars`); the engine passes its
    limit there and checks prompts' tokens itself.
    `absorb_video_vision_tokens` selects the original Qwen3-VL video layout (see media.placeholders).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        model_id: str | None = None,
        cache: PreprocessCache[Any] | None = None,
        cache_bytes: int | None = None,
        limits: DecodeLimits = DEFAULT_LIMITS,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS,
        max_prompt_tokens: int | None = None,
        absorb_video_vision_tokens: bool = False,
        max_image_tokens: int | None = None,
        prompt_limit_reason: str = "",
        max_text_tokens: int | None = None,
    ) -> None:
        root = Path(model_dir)
        if not root.is_dir():
            raise InputError(f"checkpoint directory {root} does not exist")
        if max_prompt_tokens is not None and (
            isinstance(max_prompt_tokens, bool)
            or not isinstance(max_prompt_tokens, int)
            or max_prompt_tokens <= 0
        ):
            raise InputError(f"max_prompt_tokens must be a positive int or None, got {max_prompt_tokens!r}")
        for name, pixels in (("max_image_pixels", max_image_pixels), ("max_video_pixels", max_video_pixels)):
            if isinstance(pixels, bool) or not isinstance(pixels, int) or pixels <= 0:
                raise InputError(f"{name} must be a positive int, got {pixels!r}")
        self.model_dir = root
        self.model_id = model_id if model_id is not None else str(root.resolve())
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InputError(f"model_id must be a non-empty string, got {model_id!r}")
        self.config = Qwen3VLConfig.from_pretrained(root)
        self.image_config, self.video_config = read_processor_configs(root)
        if max_image_tokens is not None:  # larger images are downscaled to what one step computes, not refused
            self.image_config = self.image_config.within_tokens(max_image_tokens)
        vision = self.config.vision
        for cfg, what in (
            (self.image_config, "preprocessor_config"),
            (self.video_config, "video_preprocessor"),
        ):
            got = (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)
            want = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
            if got != want:
                raise InputError(
                    f"{what} (patch, temporal patch, merge) = {got} disagrees with the model's vision config {want}"
                )
        self.merge_size = vision.spatial_merge_size
        self.special = SpecialTokens(
            image_pad=self.config.image_token_id,
            video_pad=self.config.video_token_id,
            vision_start=self.config.vision_start_token_id,
            vision_end=self.config.vision_end_token_id,
        )

        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise InputError(f"checkpoint file missing: {tok_file}")
        try:
            self._tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust loader raises its own exception type
            raise InputError(f"cannot load {tok_file}: {exc}") from exc
        try:
            byte_level_vocab(self._tokenizer)  # what the detokenizer and the logprobs' bytes read
        except DetokenizeError as exc:
            raise InputError(f"{tok_file}: {exc}") from exc
        for name, tid in (
            ("image_token_id", self.special.image_pad),
            ("video_token_id", self.special.video_pad),
            ("vision_start_token_id", self.special.vision_start),
            ("vision_end_token_id", self.special.vision_end),
        ):
            if self._tokenizer.id_to_token(tid) is None:
                raise InputError(f"config.json {name} {tid} is not in the tokenizer's vocabulary")
        tok_config = load_json_object(root / "tokenizer_config.json", required=False)
        source = load_chat_template(root, tok_config)
        self._chat_template = (
            ChatTemplate(source, special_token_strings(tok_config)) if source is not None else None
        )
        self._eos = read_eos_token_ids(root, tok_config, self._tokenizer)
        if cache is not None and cache_bytes is not None:
            raise InputError("pass either a shared cache or cache_bytes, not both")
        if cache is None and cache_bytes:
            cache = PreprocessCache(cache_bytes)
        self.media = MediaPreparer(self.model_id, self.image_config, self.video_config, cache, limits,
                                   max_image_pixels, max_video_pixels)
        self._limits = limits
        self._max_prompt_tokens = max_prompt_tokens
        self._max_text_tokens = max_text_tokens if max_text_tokens is not None else max_prompt_tokens
        self._reason = f" ({prompt_limit_reason})" if prompt_limit_reason else ""
        self._limit = f"the limit is {max_prompt_tokens}{self._reason}"
        self._absorb = absorb_video_vision_tokens

    # ---------------------------------------------------------------------------------- tokenizer
    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config.json eos ids, then the tokenizer's eos_token (deduplicated, in that order)."""
        return self._eos

    @property
    def cache(self) -> PreprocessCache[Any] | None:
        return self.media.cache

    @property
    def max_image_pixels(self) -> int:
        """The pixels a prompt's images may announce in all (`media.pixel_budget`)."""
        return self.media.max_image_pixels

    @property
    def max_video_pixels(self) -> int:
        """The pixels the frames a prompt's videos sample may announce in all (`media.pixel_budget`)."""
        return self.media.max_video_pixels

    @property
    def image_names(self) -> ImageNames:
        """Image uuids -> the cache keys of the images they name (`engine/image_names.py`)."""
        return self.media.image_names

    @property
    def chat_template(self) -> str | None:
        return None if self._chat_template is None else self._chat_template.source

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it are matched (the template writes them as text).
        Through `encode_batch`, which lets other threads run while it works (`encode` holds the GIL: a 6 MB prompt
        stalled the server's event loop and engine thread for ~6 s)."""
        if not isinstance(text, str):
            raise InputError(f"text must be a string, got {type(text).__name__}")
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def _refuse_texts_past_the_limit(self, text: str) -> None:
        """PromptTooLongError, before tokenizing the whole text, for one that cannot fit `max_text_tokens`: past
        `max_prompt_chars`; or, for a long one, when a head of it cut at whitespace already has more tokens (a
        margin of `_HEAD_MARGIN` tokens for the head's last word), so that at most `_HEAD_CHARS_PER_TOKEN` characters a
        token are tokenized to refuse it (Qwen's longest entry has 128 characters: the first bound alone let 16 M
        characters through at a 32K context)."""
        limit = self._max_text_tokens
        if limit is None:
            return
        too_long = f"more than {limit} tokens, the limit{self._reason}"
        if len(text) > self.max_prompt_chars:
            raise PromptTooLongError(f"the prompt has {len(text)} characters: {too_long}")
        head_chars = _HEAD_CHARS_PER_TOKEN * (limit + _HEAD_MARGIN)
        if len(text) > 2 * head_chars:
            cut = max(text.rfind(" ", 0, head_chars), text.rfind("\n", 0, head_chars))
            if cut > head_chars // 2 and len(self.encode(text[:cut])) > limit + _HEAD_MARGIN:
                raise PromptTooLongError(f"the prompt has {len(text)} characters, its first {cut} already {too_long}")

    @functools.cached_property
    def _longest_token_chars(self) -> int:
        """The vocabulary's longest entry (looked up once, when a text limit is first checked: it walks the whole
        vocabulary)."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @property
    def max_prompt_chars(self) -> int | None:
        """Characters beyond which a prompt's text cannot tokenize within `max_text_tokens` (None: no limit): each
        token covers at most the vocabulary's longest entry, with a margin of 4 for normalization that merges
        characters. Longer texts are refused before they are tokenized (a 57 MB prompt took 112 s and 6 GB to
        refuse after tokenizing)."""
        if self._max_text_tokens is None:
            return None
        return 4 * self._max_text_tokens * self._longest_token_chars

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------------------------- requests
    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[MediaInput]]:
        """Prompt text with one placeholder per media item, and the media in placeholder order."""
        if self._chat_template is None:
            raise ChatTemplateError(f"checkpoint {self.model_dir} has no chat template")
        rendered, media = parse_messages(messages, max_image_bytes=self._limits.max_bytes)
        text = self._chat_template.render(
            rendered, add_generation_prompt=add_generation_prompt, tools=tools, extra=chat_template_kwargs
        )
        return text, media

    def prepare_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        media_memo: MediaMemo | None = None,
        on_image: Callable[[PreparedImage], None] | None = None,
        bind_names: bool = True,
    ) -> PreparedPrompt:
        """`media_memo`: prompts built from the same message objects (a decision's material asked several
        questions) pass one dict, and each image object, and each video's frames object, is decoded, hashed and looked
        up once for all of them.
        `on_image`: called on this thread with each image as soon as it is prepared, while the others still are
        (the engine starts encoding it). `bind_names`: bind the uuids the images are sent with now; the engine and
        the server pass False and bind them when the engine accepts the prompt (`bind_names`), so a refused
        request names nothing."""
        text, media = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        images = [m for m in media if isinstance(m, ImageInput)]
        videos = [m for m in media if isinstance(m, VideoInput)]
        prompt = self._prepare(text, images, videos, from_chat=True, media_memo=media_memo, on_image=on_image)
        if bind_names:
            self.bind_names(prompt)
        return prompt

    def prepare_prompt(
        self,
        text: str,
        images: Sequence[Any] = (),
        videos: Sequence[VideoInput | Mapping[str, Any]] = (),
    ) -> PreparedPrompt:
        """A raw prompt holding one `<|image_pad|>` per image and one `<|video_pad|>` per video (normally
        wrapped as `<|vision_start|><|image_pad|><|vision_end|>`). Images: bytes, PIL or uint8 arrays (or
        ImageInput); videos: VideoInput or {"video": frames, "fps": ..., "num_frames"?: ...}."""
        image_inputs, video_inputs = coerce_media_lists(images, videos)
        prompt = self._prepare(text, image_inputs, video_inputs, from_chat=False)
        self.bind_names(prompt)
        return prompt

    def prepare_token_ids(self, token_ids: Sequence[int]) -> PreparedPrompt:
        """A text-only prompt given as token ids (the completions API's pre-tokenized prompt). Ids outside the
        tokenizer's vocabulary and media placeholders (there is no media to fill them) are an InputError."""
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise InputError("a token-id prompt must be a non-empty list of integers")
        vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InputError(f"token ids must be in [0, {vocab}), the tokenizer's vocabulary")
        if np.isin(ids, [self.special.image_pad, self.special.video_pad]).any():
            raise InputError("a token-id prompt must not hold image or video placeholder tokens: there is no media "
                             "to fill them")
        n = int(ids.size)
        if self._max_prompt_tokens is not None and n > self._max_prompt_tokens:
            raise PromptTooLongError(f"the prompt has {n} tokens; {self._limit}")
        return PreparedPrompt(
            token_ids=ids.astype(np.int64).tolist(),
            mm_token_type_ids=torch.zeros(n, dtype=torch.int64),
            positions=torch.arange(n, dtype=torch.int64).expand(3, n).clone(),
            rope_delta=0,
            media=(),
        )

    def bind_names(self, *prompts: PreparedPrompt) -> None:
        """Bind the uuids the prompts' images were sent with (all or none; InputError if one now names another
        image: a request sent in between took it)."""
        names = [name for prompt in prompts for name in prompt.image_names]
        if not names:
            return
        try:
            self.image_names.bind_all(names)
        except ImageNameConflict as error:
            raise InputError(str(error)) from error

    # ---------------------------------------------------------------------------------- internals
    def _prepare(
        self, text: str, images: list[ImageInput], videos: list[VideoInput], *, from_chat: bool,
        media_memo: MediaMemo | None = None,
        on_image: Callable[[PreparedImage], None] | None = None,
    ) -> PreparedPrompt:
        self._refuse_texts_past_the_limit(text)
        ids = np.asarray(self.encode(text), dtype=np.int64)
        if ids.size == 0:
            raise InputError("the prompt is empty")
        where = "the rendered chat" if from_chat else "the prompt"
        for kind, pad, given in (
            ("image", self.special.image_pad, len(images)),
            ("video", self.special.video_pad, len(videos)),
        ):
            found = int(np.count_nonzero(ids == pad))
            if found != given:
                hint = (
                    f" (text parts must not contain the {kind} placeholder token)"
                    if from_chat and found > given
                    else ""
                )
                raise InputError(
                    f"{where} has {found} {kind} placeholders but {given} {kind}s were given{hint}"
                )

        # The videos' sampling and pixel budget first: a prompt they refuse decodes (and encodes) no image either.
        video_plans = self.media.plan_videos(videos)
        prepared_images, names = self.media.images(images, {} if media_memo is None else media_memo, on_image)
        prepared_videos = self.media.videos(video_plans, media_memo)
        expanded = expand_placeholders(
            ids,
            special=self.special,
            merge_size=self.merge_size,
            image_grids=[p.grid_thw for p in prepared_images],
            videos=[VideoPlaceholder.from_video(p.video) for p in prepared_videos],
            encode_text=self.encode,
            absorb_video_vision_tokens=self._absorb,
        )
        n = int(expanded.input_ids.shape[0])
        if self._max_prompt_tokens is not None and n > self._max_prompt_tokens:
            media_tokens = sum(s.length for s in expanded.spans)
            raise PromptTooLongError(
                f"the prompt expands to {n} tokens ({media_tokens} of them media pads); {self._limit}"
            )
        positions, rope_delta = mrope_positions_from_spans(
            n,
            expanded.span_starts(),
            expanded.span_grids(),
            spatial_merge_size=self.merge_size,
            span_lengths=[s.length for s in expanded.spans],
        )

        media = place_media(expanded, prepared_images, prepared_videos)
        return PreparedPrompt(
            token_ids=expanded.input_ids.tolist(),
            mm_token_type_ids=torch.from_numpy(expanded.mm_token_type_ids),
            positions=positions,
            rope_delta=rope_delta,
            media=media,
            text=text,
            image_names=names,
        )
