"""The profile the expert store starts from, and the memory target the runtime plans it for
(what the user asked of the store is ``runtime.options.StoreOptions``).

The plan itself is ``formats.placement.plan_residency``, the one ``repack split`` uses: here the
runtime only says how it will hold the model (``memory_target``: its dtype, whether dense
matrices stay GGUF bytes, the KV cache type and the prefill calls its sessions make) and which
profile places the experts (``start_profile``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sparkpack.formats.archs import ModelSpec
from sparkpack.formats.memory import MemoryTarget, short_call_tokens, staged_call_tokens
from sparkpack.formats.profile import Profile, choose_profile, default_profile_path, model_identity
from sparkpack.formats.profile_file import ProfileFile

from .options import SessionOptions, StoreOptions


@dataclass
class StartProfile:
    """The profile a run places its experts with: ``profile`` (None: uniform placement, there
    are no counts yet), ``name`` its file for messages; with learning on, ``file`` is the profile
    file the run learns into and ``loaded`` what it held (``Profile.new`` when it did not exist)."""

    profile: Profile | None
    name: str | None
    file: ProfileFile | None = None
    loaded: Profile | None = None


def start_profile(opts: StoreOptions, model_path: Path, identity, spec: ModelSpec) -> StartProfile:
    """Learning on: the profile file is ``--profile`` or ``MODEL.profile.json`` beside the model (or
    the pack), loaded through ``ProfileFile``: a file that is not this model's profile stops the
    run with one line and is never overwritten unless ``--force`` (``LearnOptions.force``); no
    file means uniform placement and a new profile there. Learning off: an explicit profile
    must load and match, the default is used when it matches and named in one line when not."""
    if opts.learn is None:
        choice = choose_profile(opts.profile, model_path, identity, spec)
        if choice.warning:
            print(f"warning: {choice.warning}", file=sys.stderr)
        return StartProfile(choice.profile, str(choice.path) if choice.path is not None else None)
    path = opts.profile if opts.profile is not None else default_profile_path(model_path)
    file = ProfileFile(path, identity, spec, force=opts.learn.force, every_s=opts.learn.save_every_s)
    for line in file.remove_stale_temps():
        print(f"note: {line}", file=sys.stderr)
    loaded = file.load()
    learned = any(loaded.counts[s].any() for s in loaded.counts)
    return StartProfile(loaded if learned else None, str(path) if learned else None, file, loaded)


def identity_of(source) -> object:
    """The GGUF identity a profile must match: a pack carries its source GGUF's."""
    from .weights import PackAsGGUF

    return source.pack.identity if isinstance(source, PackAsGGUF) else model_identity(source)


def memory_target(device: torch.device | str, dtype: torch.dtype, spec: ModelSpec, opts: StoreOptions,
                  session: SessionOptions) -> MemoryTarget:
    """How a model of ``spec`` will be held on ``device`` in ``dtype`` by a store of ``opts`` for
    sessions of ``session``: on a GPU the dense matrices stay GGUF bytes, sessions of the models that capture
    prefill calls make none longer than ``PREFILL_GRAPH_TOKENS`` unless the context reaches past
    a long past (``formats.memory.short_call_tokens``, ``runtime.graph``), and a zero-copy store
    on a GPU stages prompt calls (``staged_chunk``: the plan decides whether the buffers fit,
    ``formats.placement``)."""
    from .graph import short_prefill_calls
    from .weights import quantizes_dense

    chunk = session.prefill_chunk
    if short_prefill_calls(device, dtype, spec, session.kv_type):
        chunk = short_call_tokens(session.ctx, chunk)
    can_stage = torch.device(device).type == "cuda" and opts.miss_mode != "async"
    return MemoryTarget(dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                        quantized_dense=quantizes_dense(torch.device(device), dtype), kv_type=session.kv_type,
                        ctx=session.ctx, prefill_chunk=chunk,
                        staged_chunk=staged_call_tokens(chunk, opts.stage_tokens) if can_stage else 0,
                        host_bytes=opts.host_ram, mtp=opts.mtp, sequences=session.sequences,
                        draft_tokens=opts.draft_tokens)
