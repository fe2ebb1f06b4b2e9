"""The whole Qwen3-VL model over packed variable-length batches.

Owns: how media features enter the token stream. Media placeholders (the checkpoint's image/video
pad token ids, or `mm_token_type_ids` 1/2 as HF's processor emits them) are replaced by the vision
encoder's merged features in order of appearance, and the same rows receive the DeepStack features
after the first decoder layers. The engine can instead pass precomputed `MultimodalEmbeddings`
(encoder cache, chunked prefill) with explicit row indices. Nothing here knows about requests or
KV pages: attention goes through the `AttentionBackend` the caller builds for the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend
from .config import Qwen3VLConfig
from .text import DeepstackInput, TextDecoder
from .vision import VisionEncoder, VisionOutput


@dataclass(frozen=True)
class MultimodalEmbeddings:
    """Visual features placed into a packed batch.

    token_index: [M] int64 rows of the batch that are media placeholder tokens.
    embeds: [M, hidden] features replacing those rows' token embeddings.
    deepstack: [num_deepstack, M, hidden] added to those rows after decoder layers 0..num_deepstack-1.
    """

    token_index: torch.Tensor
    embeds: torch.Tensor
    deepstack: torch.Tensor


@dataclass(frozen=True)
class DenseMultimodal:
    """Visual features over every row of a packed batch (a CUDA graph's static form of `MultimodalEmbeddings`).

    mask: [N] bool, True at media placeholder rows; embeds: [N, hidden] (read only where mask is set);
    deepstack: [num_deepstack, N, hidden], zeros at the other rows (added to every row: adding zero changes
    no value).
    """

    mask: torch.Tensor
    embeds: torch.Tensor
    deepstack: torch.Tensor


def last_token_indices(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Row of each packed sequence's last token (for next-token logits), computed on device."""
    return (cu_seqlens[1:] - 1).to(torch.long)


class Qwen3VLModel(nn.Module):
    def __init__(self, config: Qwen3VLConfig):
        super().__init__()
        self.config = config
        self.visual = VisionEncoder(config.vision)
        self.language_model = TextDecoder(config.text)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    # ------------------------------------------------------------------------------ pieces
    def encode_media(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> VisionOutput:
        """Vision encoder + mergers for images or video clips (patches of all items concatenated)."""
        return self.visual(pixel_values, grid_thw)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.language_model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def placeholder_rows(
        self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(image rows, video rows) of a packed batch, int64, ascending."""
        if mm_token_type_ids is not None:
            if mm_token_type_ids.shape != input_ids.shape:
                raise ValueError("mm_token_type_ids must have the shape of input_ids")
            image_mask, video_mask = mm_token_type_ids == 1, mm_token_type_ids == 2
        else:
            image_mask = input_ids == self.config.image_token_id
            video_mask = input_ids == self.config.video_token_id
        return image_mask.nonzero().flatten(), video_mask.nonzero().flatten()

    def multimodal_embeddings(
        self,
        input_ids: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
    ) -> MultimodalEmbeddings | None:
        """Run the vision encoder on the given media and pair its features with placeholder rows."""
        image_rows, video_rows = self.placeholder_rows(input_ids, mm_token_type_ids)
        parts: list[tuple[torch.Tensor, VisionOutput]] = []
        for kind, rows, pixels, grid in (
            ("image", image_rows, pixel_values, image_grid_thw),
            ("video", video_rows, pixel_values_videos, video_grid_thw),
        ):
            if pixels is None:
                if rows.numel():
                    raise ValueError(f"{rows.numel()} {kind} placeholder tokens but no {kind} pixels given")
                continue
            if grid is None:
                raise ValueError(f"{kind} pixels given without a {kind} grid_thw")
            out = self.encode_media(pixels, grid)
            if out.embeds.shape[0] != rows.numel():
                raise ValueError(
                    f"{kind} features and placeholder tokens do not match: {out.embeds.shape[0]} features, "
                    f"{rows.numel()} tokens"
                )
            parts.append((rows, out))
        if not parts:
            return None
        return MultimodalEmbeddings(
            token_index=torch.cat([r for r, _ in parts]),
            embeds=torch.cat([o.embeds for _, o in parts]),
            deepstack=torch.cat([o.deepstack for _, o in parts], dim=1),
        )

    # ------------------------------------------------------------------------------ forward
    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        multimodal: MultimodalEmbeddings | DenseMultimodal | None = None,
    ) -> torch.Tensor:
        """Packed tokens [N] + positions [3, N] -> final-normed hidden states [N, hidden]."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be flat [N], got {tuple(input_ids.shape)}")
        embeds = self.embed_tokens(input_ids)
        deepstack = None
        if isinstance(multimodal, DenseMultimodal):
            embeds = torch.where(multimodal.mask[:, None], multimodal.embeds.to(embeds.dtype), embeds)
            if multimodal.deepstack.shape[0]:
                deepstack = DeepstackInput(None, multimodal.deepstack)
        elif multimodal is not None:
            embeds = embeds.index_copy(0, multimodal.token_index, multimodal.embeds.to(embeds.dtype))
            if multimodal.deepstack.shape[0]:
                deepstack = DeepstackInput(multimodal.token_index, multimodal.deepstack)
        return self.language_model(embeds, positions, backend, deepstack)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        multimodal: MultimodalEmbeddings | DenseMultimodal | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices) or N, vocab] in the model dtype.

        Media come either as pixels + grids (encoded here; the items of all sequences concatenated
        in order of appearance) or as precomputed `multimodal`, not both. Without media every row
        is embedded as a token (a decode step; also what HF does for a generated pad token), and
        no placeholder scan or device sync happens.
        """
        has_pixels = pixel_values is not None or pixel_values_videos is not None
        if multimodal is not None and has_pixels:
            raise ValueError("pass media either as pixels or as precomputed multimodal embeddings, not both")
        if multimodal is None and has_pixels:
            multimodal = self.multimodal_embeddings(
                input_ids,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                pixel_values_videos=pixel_values_videos,
                video_grid_thw=video_grid_thw,
                mm_token_type_ids=mm_token_type_ids,
            )
        hidden = self.forward_hidden(input_ids, positions, backend, multimodal)
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.compute_logits(hidden)
