"""HF transformers as the numerical reference: processor, inputs and M-RoPE positions for parity tests.

Owns: building reference inputs with HF's own classes only (its PIL image processor, its Qwen3-VL
processor's placeholder expansion, its video patchify, its `get_rope_index`), so a parity test
feeds both models exactly what HF would. torchvision is not required: HF's Qwen3-VL video
processor needs it for resizing, so videos are given as frames already at a size divisible by
patch x merge and are normalized and patchified here with HF's own `patchify`.
Imports transformers lazily: it is a test dependency, not a runtime one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def hf_processor(model_dir: str | os.PathLike[str]):
    """HF's `Qwen3VLProcessor` with the PIL image processor, loaded from `model_dir`."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    class _PilQwen3VLProcessor(Qwen3VLProcessor):
        # HF's class check resolves BaseVideoProcessor to a torchvision-only dummy; the video
        # processor is used here only for its config, its patchify and placeholder expansion.
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    model_dir = str(Path(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return _PilQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor.from_pretrained(model_dir),
        chat_template=tokenizer.chat_template,
    )


def random_images(sizes: Sequence[tuple[int, int]], seed: int = 0):
    """PIL RGB images of the given (height, width) with deterministic random pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def user_prompt(processor, text: str, n_images: int = 0, n_videos: int = 0) -> str:
    """Chat-templated prompt: media first, then the question, then the assistant header."""
    content = (
        [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": text}]
    )
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


@dataclass
class ReferenceInputs:
    """One prompt as HF tensors (batch of 1) plus the M-RoPE positions [3, N] HF computes."""

    input_ids: torch.Tensor  # [1, N]
    mm_token_type_ids: torch.Tensor  # [1, N]
    positions: torch.Tensor  # [3, N]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    def hf_kwargs(self) -> dict:
        kw = {"input_ids": self.input_ids, "mm_token_type_ids": self.mm_token_type_ids}
        for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        return kw

    def media_kwargs(self) -> dict:
        return {k: v for k, v in self.hf_kwargs().items() if k not in ("input_ids", "mm_token_type_ids")}


def hf_positions(hf_model, inp: ReferenceInputs) -> torch.Tensor:
    """HF's M-RoPE positions [3, N] for one prompt (text-only: 0..N-1 on all three axes)."""
    if inp.image_grid_thw is None and inp.video_grid_thw is None:
        n = inp.input_ids.shape[1]
        return torch.arange(n).expand(3, n).clone()
    pos, _ = hf_model.model.get_rope_index(
        inp.input_ids,
        inp.mm_token_type_ids,
        image_grid_thw=inp.image_grid_thw,
        video_grid_thw=None if inp.video_grid_thw is None else inp.video_grid_thw.clone(),
    )
    return pos[:, 0]


def image_inputs(processor, hf_model, question: str, images: Sequence) -> ReferenceInputs:
    text = user_prompt(processor, question, n_images=len(images))
    out = processor(text=[text], images=list(images) or None, return_tensors="pt")
    inp = ReferenceInputs(
        input_ids=out["input_ids"],
        mm_token_type_ids=out["mm_token_type_ids"],
        positions=torch.empty(0),
        pixel_values=out.get("pixel_values"),
        image_grid_thw=out.get("image_grid_thw"),
    )
    inp.positions = hf_positions(hf_model, inp)
    return inp


def video_inputs(processor, hf_model, question: str, frames: np.ndarray, fps: float = 2.0) -> ReferenceInputs:
    """frames: uint8 [T, H, W, 3] with H, W divisible by patch_size * merge_size (no resize needed)."""
    from transformers.video_utils import VideoMetadata

    vp = processor.video_processor
    factor = vp.patch_size * vp.merge_size
    t, h, w, _ = frames.shape
    if h % factor or w % factor:
        raise ValueError(f"frame size {(h, w)} must be divisible by {factor}")
    mean = torch.tensor(vp.image_mean, dtype=torch.float32).view(1, 1, 3, 1, 1)
    std = torch.tensor(vp.image_std, dtype=torch.float32).view(1, 1, 3, 1, 1)
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)[None].to(torch.float32)  # [1, T, C, H, W]
    video = (video * vp.rescale_factor - mean) / std
    patches, gt, gh, gw = vp.patchify(
        video, patch_size=vp.patch_size, merge_size=vp.merge_size, temporal_patch_size=vp.temporal_patch_size
    )
    grid = torch.tensor([[gt, gh, gw]])
    meta = VideoMetadata(total_num_frames=t, fps=fps, frames_indices=list(range(t)))
    replacement = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    text = user_prompt(processor, question, n_videos=1)
    (expanded,), _ = processor.get_text_with_replacements([text], [], [replacement])
    out = processor(text=[expanded], return_tensors="pt")
    inp = ReferenceInputs(
        input_ids=out["input_ids"],
        mm_token_type_ids=out["mm_token_type_ids"],
        positions=torch.empty(0),
        pixel_values_videos=patches[0],
        video_grid_thw=grid,
    )
    inp.positions = hf_positions(hf_model, inp)
    return inp


def extend_positions(positions: torch.Tensor, n_new: int) -> torch.Tensor:
    """Positions of `n_new` text tokens appended after a prompt that ends in text."""
    start = positions.max() + 1
    new = torch.arange(n_new, dtype=positions.dtype) + start
    return torch.cat([positions, new.expand(3, n_new)], dim=1)
