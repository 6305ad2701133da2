"""Tokenizer metadata the way llama.cpp's converter writes it for byte-level BPE (``gpt2``) models.

Token list: the tokenizer's vocab plus added tokens, padded with ``[PAD{i}]`` (type UNUSED) up to
the model's ``vocab_size`` so that ids line up with the embedding rows. Token types: added tokens
flagged special, or that look special (``<|...|>``), are CONTROL, other added tokens USER_DEFINED,
the rest NORMAL. Merges, special ids and the chat template come from ``gguf.SpecialVocab``, the
same helper llama.cpp uses.

``tokenizer.ggml.pre`` names llama.cpp's pre-tokenizer regex. llama.cpp picks it by hashing the
tokenization of a probe text, which only recognises released tokenizers; we name the family's
pre-tokenizer instead ("qwen2" for Qwen3, "qwen35" for Qwen3.5/3.6, "laguna" for Laguna), which is
what the converter gives for the real checkpoints of these families.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparkpack.formats.errors import SparkpackError

# gguf.TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _looks_special(token: str) -> bool:
    return (token.startswith("<|") and token.endswith("|>")) or (token.startswith("<｜") and token.endswith("｜>")) \
        or token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") \
        or (token.startswith("<unused") and token.endswith(">"))


def read_vocab(hf_dir: Path, vocab_size: int | None) -> tuple[list[str], list[int]]:
    """Tokens and token types, indexed by id, padded to ``vocab_size``."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise SparkpackError(hf_dir, "no tokenizer.json (only fast byte-level BPE tokenizers are supported)")
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
        model = tok["model"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise SparkpackError(path, f"malformed tokenizer.json ({e})") from None
    if model.get("type") != "BPE":
        raise SparkpackError(path, f"tokenizer model is {model.get('type')!r}; only BPE is supported")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added: dict[int, dict[str, Any]] = {}
    for a in tok.get("added_tokens", []):
        by_id[int(a["id"])] = a["content"]
        added[int(a["id"])] = a
    n = vocab_size if vocab_size is not None else max(by_id) + 1
    if max(by_id) >= n:
        raise SparkpackError(path, f"tokenizer has id {max(by_id)} but the model's vocab_size is {n}")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        t = by_id[i]
        tokens.append(t)
        if i in added:
            types.append(CONTROL if added[i].get("special") or _looks_special(t) else USER_DEFINED)
        else:
            types.append(NORMAL)
    return tokens, types


def add_tokenizer(writer, hf_dir: Path, vocab_size: int | None, pre: str,
                  control_tokens: tuple[str, ...] = ()) -> None:
    """Write tokenizer.ggml.* keys and the chat template. ``control_tokens`` are promoted to CONTROL
    (Laguna's ``</assistant>`` turn end, which the HF tokenizer does not flag special)."""
    import gguf

    tokens, types = read_vocab(hf_dir, vocab_size)
    for i, t in enumerate(tokens):
        if t in control_tokens:
            types[i] = CONTROL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise SparkpackError(hf_dir / "tokenizer.json", "BPE tokenizer without merges")
    special.add_to_gguf(writer, quiet=True)
