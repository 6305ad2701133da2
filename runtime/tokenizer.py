"""The model's tokenizer rebuilt from its GGUF metadata (``tokenizer.ggml.*``).

A GGUF (and a .sparkpack, whose manifest carries the same keys) has no tokenizer.json, so the
byte-level BPE is reassembled here with the HF ``tokenizers`` library from the token list, the
merges and the pre-tokenizer *name*; the split regex for each name is the original HF one that
llama.cpp adapts in ``llama-vocab.cpp``. Like llama.cpp (and unlike Qwen's tokenizer.json) no NFC
normaliser is applied: the GGUF does not record one, and llama.cpp is the behaviour GGUF users get.

CONTROL tokens become special added tokens and USER_DEFINED ones plain added tokens, so both
encode as single ids (``<|im_start|>``, ``<think>``) and only CONTROL ones are dropped by
``decode(skip_special=True)``, as in transformers.
"""
from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np
from gguf.vocab import bytes_to_unicode

from sparkpack.formats.errors import SparkpackError

MAX_ENCODE_CHARS = 4 << 20  # twice a corpus record's cap (calibrate/readers/base.py), for its template

# gguf.TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# tokenizer.ggml.pre -> (split regexes applied in sequence, ignore_merges). Laguna first cuts the
# text into lines and newline runs, then applies the Qwen2 pattern inside each piece.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2,), False),
    "gpt-2": ((_GPT2,), False),
    "gpt2": ((_GPT2,), False),
    "qwen2": ((_QWEN2,), False),
    "deepseek-r1-qwen": ((_QWEN2,), False),
    "qwen35": ((_QWEN35,), False),
    "laguna": ((r"[^\n]+|[\n]+", _QWEN2), False),
    "llama-bpe": ((_LLAMA3,), True),
    "llama3": ((_LLAMA3,), True),
    "llama-v3": ((_LLAMA3,), True),
}

# End-of-generation token texts, the list llama.cpp marks as EOG, plus Laguna's turn end.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "</assistant>",
})


# byte-level BPE tokens spell bytes in GPT-2's printable stand-ins (gguf-py has the map)
_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}

class ModelMetadata(Protocol):
    """A model file's metadata by key: ``formats.gguf_file.GGUFModel``, ``runtime.weights.PackAsGGUF``."""

    path: os.PathLike[str]

    def get(self, key: str, default: Any = None) -> Any: ...


class IncrementalDecoder:
    """Incremental detokenizer: ``push(id)`` returns only complete text, holding back the bytes
    of a UTF-8 character split across tokens (emoji and CJK often are) until it is whole."""

    def __init__(self, tokenizer: "GGUFTokenizer", skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id, self._skip))

    def flush(self) -> str:
        """Whatever is still held (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class GGUFTokenizer:
    """Encode/decode with a GGUF model's own vocabulary; ids equal those of the HF tokenizer.json
    the GGUF was converted from."""

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], pre: str,
                 special_ids: dict[str, int | None], add_bos: bool = False, add_eos: bool = False,
                 where: str | None = None):
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        if pre not in PRE_TOKENIZERS:
            raise SparkpackError(where, f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                                        f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        regexes, ignore_merges = PRE_TOKENIZERS[pre]
        self.tokens = tokens
        self.token_types = token_types
        self.vocab_size = len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise SparkpackError(where, f"malformed merge {m!r} in tokenizer.ggml.merges")
            pairs.append((a, b))
        try:  # the library checks that every merge and its result are tokens; its error names no field
            bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False)
        except Exception as e:
            raise SparkpackError(where, f"tokenizer.ggml.merges does not fit tokenizer.ggml.tokens ({e})") from None
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        added = [AddedToken(tokens[i], special=token_types[i] == CONTROL, normalized=False)
                 for i in range(len(tokens)) if token_types[i] in (CONTROL, USER_DEFINED)]
        if added:
            tok.add_tokens(added)
        self._tok = tok
        self._special = frozenset(i for i, t in enumerate(token_types) if t == CONTROL)
        self._added = frozenset(i for i, t in enumerate(token_types) if t in (CONTROL, USER_DEFINED))
        self._added_ids = np.array(sorted(self._added), dtype=np.int64)
        self.bos_id = special_ids.get("bos")
        self.eos_id = special_ids.get("eos")
        self.eot_id = special_ids.get("eot")
        self.eom_id = special_ids.get("eom")
        self.pad_id = special_ids.get("pad")
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.add_eos = bool(add_eos) and self.eos_id is not None
        stops = {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        stops |= {i for i in self._added if tokens[i] in _EOG_TEXTS}
        self.stop_ids: frozenset[int] = frozenset(stops)

    @property
    def end_of_turn(self) -> int:
        """The token that ends an assistant's reply (a forced output or a finished grammar ends with it)."""
        return next((i for i in (self.eot_id, self.eos_id) if i is not None), min(self.stop_ids, default=0))

    @classmethod
    def from_metadata(cls, source: ModelMetadata | Mapping[str, Any]) -> "GGUFTokenizer":
        """From a model file (errors name it) or a dict of its metadata."""
        get = source.get
        where = None if isinstance(source, Mapping) else os.fspath(source.path)
        model = get("tokenizer.ggml.model")
        if model is None:
            raise SparkpackError(where, "has no tokenizer (tokenizer.ggml.model is missing)")
        if model != "gpt2":
            raise SparkpackError(where, f"tokenizer model {model!r} is not supported (only byte-level BPE, "
                                        "tokenizer.ggml.model = 'gpt2')")
        tokens, merges = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise SparkpackError(where, "tokenizer.ggml.tokens or tokenizer.ggml.merges is missing or empty")
        types = get("tokenizer.ggml.token_type")
        types = [NORMAL] * len(tokens) if types is None else types
        for key, value, kind in (("tokens", tokens, str), ("merges", merges, str), ("token_type", types, int)):
            if not isinstance(value, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in value):
                raise SparkpackError(where, f"tokenizer.ggml.{key} must be an array of "
                                            f"{'strings' if kind is str else 'integers'}")
        if len(types) != len(tokens):
            raise SparkpackError(where, f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

        def tid(name: str) -> int | None:
            v = get(f"tokenizer.ggml.{name}_token_id")
            return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(tokens) else None

        ids = {n: tid(n) for n in ("bos", "eos", "eot", "eom", "pad")}
        return cls(tokens, merges, types, str(get("tokenizer.ggml.pre") or "default"), ids,
                   add_bos=bool(get("tokenizer.ggml.add_bos_token")), add_eos=bool(get("tokenizer.ggml.add_eos_token")),
                   where=where)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Special-token texts in ``text`` always become their single ids; ``add_special`` adds
        the BOS/EOS the model asks for (tokenizer.ggml.add_bos_token / add_eos_token).

        At most ``MAX_ENCODE_CHARS`` characters at once: the tokenizer needs ~200-400 bytes per
        character while it works (4M characters took +1.5 GB here; a 64 MB line aborted the
        process), so longer text is refused with a ``SparkpackError`` before it starts."""
        ids = self._encoding(text).ids
        if add_special:
            if self.add_bos:
                ids = [self.bos_id, *ids]
            if self.add_eos:
                ids = [*ids, self.eos_id]
        return ids

    def encode_marked(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` (no BOS/EOS) and where its added tokens are: ``(character offset in
        text, index in the ids)`` of each, in order. The tokenizer splits the text at added tokens
        (leftmost, longest match) before anything else and tokenizes the pieces between them
        alone, so these are the places where a text may be tokenized in two parts
        (``runtime.server.prompt_tokens``)."""
        enc = self._encoding(text)
        ids = enc.ids
        at = np.flatnonzero(np.isin(np.asarray(ids, dtype=np.int64), self._added_ids)).tolist()
        # (the offsets of these tokens only: all of them cost a large share of the encode)
        return ids, [(enc.token_to_chars(i)[0], i) for i in at]

    @property
    def longest_added(self) -> int:
        """Characters of the longest added token (how far a match may reach past its start)."""
        return max((len(self.tokens[i]) for i in self._added), default=0)

    def _encoding(self, text: str):
        if len(text) > MAX_ENCODE_CHARS:
            raise SparkpackError(None, f"text of {len(text)} characters is more than the {MAX_ENCODE_CHARS} the "
                                       "tokenizer takes at once")
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        text = self.tokens[token_id]
        if token_id in self._added:
            return b"" if skip_special and token_id in self._special else text.encode("utf-8")
        try:
            return bytes(_UNICODE_TO_BYTE[c] for c in text)
        except KeyError:  # a token outside the byte alphabet: its text is its bytes
            return text.encode("utf-8")

    def decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special)

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the pre-tokenizer (the GGUF's ``tokenizer.ggml.pre`` pattern) cuts ``text`` into."""
        return [p for p, _ in self._tok.pre_tokenizer.pre_tokenize_str(text)]

    @property
    def control_ids(self) -> frozenset[int]:
        """The CONTROL tokens: where a chat template starts and ends messages (``<|im_start|>``,
        ``<|im_end|>``; Laguna's ``<user>``...), so where a session may end a prefill call
        (``runtime.generate.Session``)."""
        return self._special

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)
