"""Placement profiles: how often each (layer, expert) was routed to, tied to one model.

``repack calibrate`` writes them, ``repack split`` reads them to choose the hot experts. The file is
JSON so a person can open it and see which experts are busy; counts are kept per side (prompt
tokens vs generated tokens) because a cold miss while decoding costs one stall per token, while a
prompt is processed in batches where the copy is shared by many tokens. Format: docs/FORMAT.md.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .archs import ModelSpec
from .atomic_file import write_atomic
from .checksums import IDENTITY_ALGORITHM, hash_file_range, is_checksum
from .errors import FormatError, SparkpackError
from .gguf_file import GGUFModel
from .safe_read import load_json

PROFILE_FORMAT = "sparkpack-profile"
PROFILE_VERSION = 1
SIDES = ("prompt", "generated")
MAX_PROFILE_BYTES = 64 << 20  # a full-size model's profile is ~0.3 MB
MAX_PROFILE_DEPTH = 8
MAX_LAYERS_EXPERTS = 1 << 20  # bound on n_layer and n_expert (real models: 40-94 and 128-512)


@dataclass(frozen=True)
class ModelIdentity:
    """Which GGUF a profile or pack belongs to: file size plus a hash of everything before the
    tensor data (metadata and tensor index). Hashing only the header keeps it instant on 20 GB
    files; two files with equal identity have the same metadata, tensor names, types and offsets
    and can differ only in weight bytes."""

    file_size: int
    header_bytes: int
    header_hash: str  # "sha256:<hex>"

    def to_json(self) -> dict[str, Any]:
        return {"file_size": self.file_size, "header_bytes": self.header_bytes, "header_hash": self.header_hash}

    @classmethod
    def from_json(cls, d: Any, where: str | os.PathLike[str]) -> "ModelIdentity":
        if not isinstance(d, dict) or not all(_is_int(d.get(k)) and d[k] >= 0 for k in ("file_size", "header_bytes")) \
                or not is_checksum(d.get("header_hash"), IDENTITY_ALGORITHM):
            raise FormatError(where, "model identity must have file_size, header_bytes (integers) and "
                                     f"header_hash ({IDENTITY_ALGORITHM}:<hex>)")
        return cls(d["file_size"], d["header_bytes"], d["header_hash"])

    def short(self) -> str:
        return f"{self.file_size} bytes, header {self.header_hash.split(':')[-1][:12]}"


def default_profile_path(model_path: str | os.PathLike[str]) -> Path:
    """``model.gguf`` -> ``model.profile.json`` beside it (where calibrate writes, spark-run looks)."""
    model_path = Path(model_path)
    return model_path.with_name(model_path.stem + ".profile.json")


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a command places experts with: the one given, else ``MODEL.profile.json``
    beside the model when it belongs to it. ``warning`` is one line for the user when that file
    is there but cannot be used (another model's, or unreadable)."""

    profile: "Profile | None"
    path: Path | None
    warning: str | None = None


def choose_profile(given: str | os.PathLike[str] | None, model_path: str | os.PathLike[str],
                   identity: "ModelIdentity", spec: ModelSpec) -> ProfileChoice:
    """``given`` must load and match (its errors stop the command); the default beside the model
    is used when it matches and reported when it does not, so a calibration is never dropped
    without a word."""
    if given is not None:
        prof = Profile.load(given)
        prof.check_model(identity, spec, given)
        return ProfileChoice(prof, Path(given))
    guess = default_profile_path(model_path)
    if not guess.is_file():
        return ProfileChoice(None, None)
    try:
        prof = Profile.load(guess)
        prof.check_model(identity, spec, guess)
    except SparkpackError as e:
        return ProfileChoice(None, None, f"ignoring {guess}: {e.problem} (recalibrate this model, or pass --profile)")
    return ProfileChoice(prof, guess)


def model_identity(model: GGUFModel) -> ModelIdentity:
    """Identity of an open GGUF (reads only its header bytes)."""
    n = model.data_offset
    return ModelIdentity(model.file_size, n, hash_file_range(model.path, 0, n, IDENTITY_ALGORITHM))


@dataclass(frozen=True)
class Decay:
    """How a live run's counts were aged: every token processed multiplies all counts and token
    totals by ``2 ** (-1 / half_life_tokens)`` (``formats.decayed_routing``). ``tokens_seen`` is
    the undecayed number of tokens learned from, so a reader can tell a young profile from an
    old one. A profile without it holds plain sums (``repack calibrate``)."""

    half_life_tokens: float
    tokens_seen: float

    def to_json(self) -> dict[str, Any]:
        return {"half_life_tokens": _num(self.half_life_tokens), "tokens_seen": _num(self.tokens_seen)}

    @classmethod
    def from_json(cls, d: Any, where: str | os.PathLike[str]) -> "Decay":
        if not isinstance(d, dict) or not all(_is_number(d.get(k)) for k in ("half_life_tokens", "tokens_seen")):
            raise FormatError(where, "decay must have half_life_tokens and tokens_seen (numbers)")
        half, seen = float(d["half_life_tokens"]), float(d["tokens_seen"])
        if not (math.isfinite(half) and half > 0 and math.isfinite(seen) and seen >= 0):
            raise FormatError(where, "decay half_life_tokens must be finite and > 0, tokens_seen finite and >= 0")
        return cls(half, seen)


@dataclass
class Profile:
    """Routing counts per (layer, expert) for prompt-side and generated-side tokens."""

    identity: ModelIdentity
    arch: str
    n_layer: int
    n_expert: int
    moe_layers: list[int]
    counts: dict[str, np.ndarray] = field(default_factory=dict)  # side -> float64 [n_layer, n_expert]
    tokens: dict[str, float] = field(default_factory=dict)  # side -> tokens seen
    decay: Decay | None = None  # set by a live learner (decayed counts); None: plain sums

    @classmethod
    def new(cls, identity: ModelIdentity, spec: ModelSpec) -> "Profile":
        return cls(identity, spec.arch, spec.n_layer, spec.n_expert, list(spec.moe_layers),
                   {s: np.zeros((spec.n_layer, spec.n_expert)) for s in SIDES}, {s: 0.0 for s in SIDES})

    def add(self, prompt: np.ndarray | None = None, generated: np.ndarray | None = None,
            prompt_tokens: float = 0, generated_tokens: float = 0) -> None:
        """Accumulate routing counts ([n_layer, n_expert] arrays) and the tokens they came from."""
        for side, arr, ntok in (("prompt", prompt, prompt_tokens), ("generated", generated, generated_tokens)):
            if arr is not None:
                a = np.asarray(arr, dtype=np.float64)
                if a.shape != (self.n_layer, self.n_expert):
                    raise ValueError(f"{side} counts have shape {a.shape}, expected {(self.n_layer, self.n_expert)}")
                if (a < 0).any():
                    raise ValueError(f"{side} counts must be >= 0")
                self.counts[side] += a
            if ntok < 0:
                raise ValueError("token counts must be >= 0")
            self.tokens[side] += float(ntok)

    def merge(self, other: "Profile", decay: float = 1.0) -> "Profile":
        """A new profile: this one's counts scaled by ``decay`` (older traffic matters less) plus
        ``other``'s. Both must describe the same model."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        if other.identity != self.identity or (other.n_layer, other.n_expert) != (self.n_layer, self.n_expert):
            raise SparkpackError(None, f"cannot merge profiles of different models ({self.identity.short()} vs "
                                       f"{other.identity.short()})")
        return Profile(self.identity, self.arch, self.n_layer, self.n_expert, list(self.moe_layers),
                       {s: self.counts[s] * decay + other.counts[s] for s in SIDES},
                       {s: self.tokens[s] * decay + other.tokens[s] for s in SIDES})

    def copy(self) -> "Profile":
        """An independent snapshot (a writer thread may save it while learning goes on)."""
        return Profile(self.identity, self.arch, self.n_layer, self.n_expert, list(self.moe_layers),
                       {s: self.counts[s].copy() for s in SIDES}, dict(self.tokens), self.decay)

    def check_model(self, identity: ModelIdentity, spec: ModelSpec, where: str | os.PathLike[str]) -> None:
        """Refuse a profile recorded on another model: its counts would place the wrong experts."""
        if (self.n_layer, self.n_expert) != (spec.n_layer, spec.n_expert):
            raise SparkpackError(where, f"profile has {self.n_layer} layers x {self.n_expert} experts, the model "
                                        f"has {spec.n_layer} x {spec.n_expert}")
        if list(self.moe_layers) != list(spec.moe_layers):
            raise SparkpackError(where, f"profile's MoE layers {_short_list(self.moe_layers)} are not the model's "
                                        f"{_short_list(spec.moe_layers)}")
        if self.identity != identity:
            raise SparkpackError(where, f"profile is for another model ({self.identity.short()}), not this one "
                                        f"({identity.short()})")

    # --- files --------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        d = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "identity": self.identity.to_json(),
            "arch": self.arch,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "moe_layers": self.moe_layers,
            "tokens": {s: _num(self.tokens[s]) for s in SIDES},
            "counts": {s: [[_num(x) for x in row] for row in self.counts[s].tolist()] for s in SIDES},
        }
        if self.decay is not None:
            d["decay"] = self.decay.to_json()
        return d

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically and durably (``formats.atomic_file``): a reader, or a crash at any
        moment, sees the old profile or the new one, never half of one."""
        return write_atomic(path, json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Profile":
        path = Path(path)
        if not path.exists():
            raise SparkpackError(path, "no such profile file")
        d = load_json(path, "a profile", MAX_PROFILE_BYTES, MAX_PROFILE_DEPTH)
        return cls.from_json(d, path)

    @classmethod
    def from_json(cls, d: Any, where: str | os.PathLike[str]) -> "Profile":
        """A profile from its parsed JSON, every field checked (types, shapes, finite values >= 0):
        one ``FormatError`` naming the field otherwise."""
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise FormatError(where, f"not a profile (format is not {PROFILE_FORMAT!r})")
        if d.get("version") != PROFILE_VERSION or isinstance(d.get("version"), bool):
            raise FormatError(where, f"profile version {str(d.get('version'))[:20]} is not supported "
                                     f"(expected {PROFILE_VERSION})")
        n_layer, n_expert = d.get("n_layer"), d.get("n_expert")
        for name, v in (("n_layer", n_layer), ("n_expert", n_expert)):
            if not _is_int(v) or not 1 <= v <= MAX_LAYERS_EXPERTS:
                raise FormatError(where, f"{name} must be an integer 1..{MAX_LAYERS_EXPERTS}")
        moe = d.get("moe_layers", list(range(n_layer)))
        if not isinstance(moe, list) or not all(_is_int(x) and 0 <= x < n_layer for x in moe):
            raise FormatError(where, f"moe_layers must be layer numbers 0..{n_layer - 1}")
        if moe != sorted(set(moe)):
            raise FormatError(where, "moe_layers must list each layer once, in increasing order")
        if not isinstance(d.get("arch"), str):
            raise FormatError(where, "arch must be a string")
        counts, tokens = d.get("counts"), d.get("tokens")
        if not isinstance(counts, dict) or not isinstance(tokens, dict):
            raise FormatError(where, "counts and tokens must be objects with prompt and generated entries")
        prof = cls(ModelIdentity.from_json(d.get("identity"), where), d["arch"], n_layer, n_expert, list(moe), {}, {})
        dense = sorted(set(range(n_layer)) - set(moe))  # layers without experts route nowhere
        for s in SIDES:
            prof.counts[s] = _count_matrix(counts.get(s), (n_layer, n_expert), where, f"{s} counts")
            routed = [il for il in dense if prof.counts[s][il].any()]
            if routed:
                raise FormatError(where, f"{s} counts route tokens in layer {routed[0]}, which moe_layers does not "
                                         "list (a layer without experts)")
            tok = tokens.get(s)
            if not _is_number(tok) or not math.isfinite(float(tok)) or tok < 0:
                raise FormatError(where, f"{s} token count must be a finite number >= 0")
            prof.tokens[s] = float(tok)
        if d.get("decay") is not None:
            prof.decay = Decay.from_json(d["decay"], where)
        return prof


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """An int or float, not a bool; ints too large for a float (2**1100) are not numbers here."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _count_matrix(rows: Any, shape: tuple[int, int], where: str | os.PathLike[str], what: str) -> np.ndarray:
    """``rows`` as a float64 ``shape`` array of finite counts >= 0, checked element by element
    (numpy would turn strings and bools into numbers, and overflow on 2**1100)."""
    if not isinstance(rows, list) or len(rows) != shape[0] or \
            not all(isinstance(r, list) and len(r) == shape[1] for r in rows):
        have = [len(rows), len(rows[0]) if rows and isinstance(rows[0], list) else "?"] if isinstance(rows, list) else "?"
        raise FormatError(where, f"{what} have shape {have}, expected [{shape[0]}, {shape[1]}]")
    if not all(_is_number(x) for r in rows for x in r):
        raise FormatError(where, f"{what} must be numbers")
    arr = np.asarray(rows, dtype=np.float64)
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise FormatError(where, f"{what} must be finite and >= 0")
    return arr


def _short_list(xs: list[int], n: int = 8) -> str:
    return "[" + ", ".join(map(str, xs[:n])) + (", ..." if len(xs) > n else "") + "]"


def _num(x: float) -> int | float:
    """Whole counts print as integers, so an undecayed profile reads naturally."""
    return int(x) if float(x).is_integer() else float(x)
