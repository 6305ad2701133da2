"""A small but working byte-level BPE vocabulary for synthetic models.

Tokenizer code (ours and llama.cpp's) must run on synthetic models exactly as on real ones, so the
vocabulary follows GPT-2/Qwen conventions: 256 byte tokens in GPT-2's byte-to-unicode form, merges
learned from a built-in text (common English and code words become single tokens), the family's
special tokens at their real ids for full-size presets, and filler up to the vocabulary size.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from gguf.vocab import bytes_to_unicode

# tokenizer.ggml.token_type values (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Qwen's pre-tokenizer split (llama.cpp's "qwen2" regex) in stdlib ``re`` terms (\p{L} = [^\W\d_]);
# merges are learned within these pieces so the real pre-tokenizer can reach them.
PRETOKENIZE = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?[^\W\d_]+|\d| ?(?:[^\s\w]|_)+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = """
The model reads the prompt and writes an answer. The user asks a question and the assistant answers it.
A mixture of experts routes each token to a few experts, and the experts that your traffic uses stay on
the GPU while the rest wait in host memory. This is a test of the tokenizer: hello world, it works.
def main(): return print("hello world") if the value is None else the result of the function call
import numpy as np; import torch; for i in range(10): x = x + i; class Model: pass
The quick brown fox jumps over the lazy dog. Please write a function that returns the sum of a list.
You are a helpful assistant. What is the weather today? I will call a tool to get the answer for you.
system user assistant tool tools function name arguments content message messages response error file
""" * 3 + " the and of to in is that for it with as on this be are was by an or not from at have"


def learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training on the pre-tokenized words of ``text`` (ties broken by pair, so stable)."""
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode()) for w in PRETOKENIZE.findall(text))
    split = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, parts in split.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        for w, parts in split.items():
            i, out = 0, []
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    out.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[w] = out
    return merges


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "a b" pairs, as tokenizer.ggml.merges stores them
    pre: str
    bos_id: int
    eos_id: int
    eot_id: int
    pad_id: int
    add_bos: bool


# Special tokens per family, in id order starting at the preset's ``special_start``.
# Qwen: the Qwen2.5/3 added tokens (ids 151643.. in Qwen3, 248044.. in Qwen3.5/3.6).
QWEN_SPECIALS = [
    ("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
    ("<|object_ref_start|>", CONTROL), ("<|object_ref_end|>", CONTROL), ("<|box_start|>", CONTROL),
    ("<|box_end|>", CONTROL), ("<|quad_start|>", CONTROL), ("<|quad_end|>", CONTROL),
    ("<|vision_start|>", CONTROL), ("<|vision_end|>", CONTROL), ("<|vision_pad|>", CONTROL),
    ("<|image_pad|>", CONTROL), ("<|video_pad|>", CONTROL), ("<tool_call>", USER_DEFINED),
    ("</tool_call>", USER_DEFINED), ("<|fim_prefix|>", USER_DEFINED), ("<|fim_middle|>", USER_DEFINED),
    ("<|fim_suffix|>", USER_DEFINED), ("<|fim_pad|>", USER_DEFINED), ("<|repo_name|>", USER_DEFINED),
    ("<|file_sep|>", USER_DEFINED), ("<tool_response>", USER_DEFINED), ("</tool_response>", USER_DEFINED),
    ("<think>", USER_DEFINED), ("</think>", USER_DEFINED),
]
# Laguna: bos = eos = 2, turn end "</assistant>" = 24 (eot), as the released config has; the other
# names are stand-ins in the same role-tag style.
LAGUNA_SPECIALS = [
    ("<unk>", CONTROL), ("<pad>", CONTROL), ("〈|EOS|〉", CONTROL), ("<system>", CONTROL), ("</system>", CONTROL),
    ("<user>", CONTROL), ("</user>", CONTROL), ("<tools>", USER_DEFINED), ("</tools>", USER_DEFINED),
    ("<tool_call>", USER_DEFINED), ("</tool_call>", USER_DEFINED), ("<tool_response>", USER_DEFINED),
    ("</tool_response>", USER_DEFINED), ("<think>", USER_DEFINED), ("</think>", USER_DEFINED),
    ("<arg_key>", USER_DEFINED), ("</arg_key>", USER_DEFINED), ("<arg_value>", USER_DEFINED),
    ("</arg_value>", USER_DEFINED), ("<|fim_prefix|>", USER_DEFINED), ("<|fim_middle|>", USER_DEFINED),
    ("<|fim_suffix|>", USER_DEFINED), ("<|file_sep|>", USER_DEFINED), ("<assistant>", CONTROL),
    ("</assistant>", CONTROL),
]


@lru_cache(maxsize=8)
def build_vocab(family: str, n_vocab: int, special_start: int, pre: str, n_merges: int = 700) -> Vocab:
    """Vocabulary of exactly ``n_vocab`` tokens for ``family`` ("qwen" or "laguna"); ``pre`` is the
    llama.cpp pre-tokenizer name (tokenizer.ggml.pre)."""
    specials = QWEN_SPECIALS if family == "qwen" else LAGUNA_SPECIALS
    b2u = bytes_to_unicode()
    base = list(b2u.values())  # GPT-2 order: printable bytes first
    merges = learn_merges(CORPUS, n_merges)
    learned = [a + b for a, b in merges]
    seen: set[str] = set()
    bpe = [t for t in base + learned if not (t in seen or seen.add(t))]
    tokens: list[str] = []
    types: list[int] = []
    if special_start == 0:  # specials first (laguna), then the BPE vocabulary
        tokens += [s for s, _ in specials]
        types += [t for _, t in specials]
    if special_start and special_start < len(bpe):
        raise ValueError(f"special tokens at {special_start} would overlap the {len(bpe)} BPE tokens")
    tokens += bpe
    types += [NORMAL] * len(bpe)
    if special_start:
        # filler so the specials land at their real ids; unreachable by any merge
        tokens += [f"[FILL{i}]" for i in range(len(tokens), special_start)]
        types += [UNUSED] * (special_start - len(types))
        tokens += [s for s, _ in specials]
        types += [t for _, t in specials]
    if len(tokens) > n_vocab:
        raise ValueError(f"vocabulary of {n_vocab} is too small for {len(tokens)} base and special tokens")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [UNUSED] * (n_vocab - len(types))
    ids = {t: i for i, t in enumerate(tokens)}
    if family == "qwen":
        return Vocab(tokens, types, [f"{a} {b}" for a, b in merges], pre, bos_id=ids["<|endoftext|>"],
                     eos_id=ids["<|im_end|>"], eot_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"], add_bos=False)
    return Vocab(tokens, types, [f"{a} {b}" for a, b in merges], pre, bos_id=ids["〈|EOS|〉"],
                 eos_id=ids["〈|EOS|〉"], eot_id=ids["</assistant>"], pad_id=ids["<pad>"], add_bos=True)
