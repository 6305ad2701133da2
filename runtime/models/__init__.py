"""Model registry: GGUF architecture name -> model class, and ``load_model`` to open a file."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import UnsupportedError
from sparkpack.formats.gguf_file import GGUFModel

from ..experts import ExpertProvider, GGUFExperts
from ..options import SessionOptions, StoreOptions
from ..weights import PackAsGGUF
from .base import MoEModel
from .laguna import Laguna
from .qwen3moe import Qwen3MoE
from .qwen35moe import Qwen35MoE

MODELS: dict[str, type[MoEModel]] = {m.arch: m for m in (Qwen3MoE, Qwen35MoE, Laguna)}


def load_model(path: str | os.PathLike[str] | GGUFModel, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, dequant_limit: int | None = None,
               store: StoreOptions | None = None, session: SessionOptions = SessionOptions()) -> MoEModel:
    """Open a GGUF or a .sparkpack directory and build the runtime model of its architecture
    (dense weights load lazily, or at once with ``store``).

    Without ``store`` experts are expanded on first use (``dequant_limit`` bounds the bytes that
    stay expanded; None keeps all): the simple path, used on CPU. With ``store`` the tiered expert
    store holds them quantized (hot set, cache slots, host tier) as ``store`` asks, planned for
    sessions of ``session`` (its context, KV type and prompt calls); the plan is kept on
    the model as ``model.residency`` (the store as ``model.store``) and the profile it was placed with (and, learning, the
    profile file to learn into) as ``model.start_profile``."""
    from sparkpack.formats.sparkpack import Pack, is_pack

    pack = None
    if not isinstance(path, GGUFModel) and is_pack(path):
        pack = Pack.open(path)
        source = PackAsGGUF(pack)
    else:
        source = path if isinstance(path, GGUFModel) else GGUFModel(path)
    spec = model_spec(source)  # type: ignore[arg-type]
    cls = _model_class(source, spec)
    experts: ExpertProvider
    residency = start = None
    if store is not None:
        from ..residency import identity_of, start_profile

        start = start_profile(store, Path(source.path), identity_of(source), spec)
        experts, residency = open_store(source, pack, spec, device, dtype, store, session=session, start=start)
    else:
        experts = GGUFExperts(source, spec, device, dtype, max_bytes=dequant_limit)  # type: ignore[arg-type]
    model = cls(source, spec, device=device, dtype=dtype, experts=experts)  # type: ignore[arg-type]
    model.residency = residency
    model.store = experts if store is not None else None  # type: ignore[assignment]
    model.start_profile = start
    if store is not None:  # a budget must fail (or hold) at load, not in the middle of a reply
        from sparkpack.formats.experts import expert_tensor_names

        for group in model.stack_groups():  # stacked first: no part is ever held twice
            model.w.stacked(group)
        skip = expert_tensor_names(spec) | spec.head_tensor_names()  # the MTP head loads with load_mtp
        model.w.preload(n for n in source.tensors if n not in skip)
        if store.mtp and spec.nextn is not None:  # (--draft mtp on a file without one: open_drafter says so)
            model.load_mtp()  # type: ignore[attr-defined]
    return model


def open_store(source, pack, spec, device, dtype: torch.dtype, opts: StoreOptions, *,
               session: SessionOptions = SessionOptions(), start=None):
    """The tiered expert store and its residency plan for an opened model file (``pack`` the
    ``.sparkpack`` or None for a GGUF). Benchmarks use it to swap stores under one loaded model."""
    from ..expert_store import ExpertStore

    experts_src, residency = plan_store(source, pack, spec, device, dtype, opts, session=session, start=start)
    store = ExpertStore(experts_src, spec, device, dtype, residency.hot, residency.cache_slots, opts.miss_mode,
                        opts.host_ram, stage_tokens=opts.stage_tokens if residency.staging_bytes else None)
    return store, residency


def plan_store(source, pack, spec, device, dtype: torch.dtype, opts: StoreOptions, *,
               session: SessionOptions = SessionOptions(), start=None):
    """Where an opened model file's experts come from and the residency plan ``opts`` asks for
    sessions of ``session`` (what ``open_store`` builds its store from):
    ``formats.placement.plan_residency``, the plan ``repack split`` makes, for this device and dtype, with the profile ``start``
    (``runtime.residency.StartProfile``; None: the one ``opts`` names or finds)."""
    from sparkpack.formats.placement import plan_residency

    from ..expert_source import GGUFExpertSource, PackExpertSource
    from ..residency import identity_of, memory_target, start_profile

    experts_src = PackExpertSource(pack, spec) if pack is not None else GGUFExpertSource(source, spec)
    if start is None:
        start = start_profile(opts, Path(source.path), identity_of(source), spec)
    residency = plan_residency(spec, source.tensors, opts.budget, memory_target(device, dtype, spec, opts, session),
                               profile=start.profile, profile_name=start.name,
                               pack_hot=pack.hot if pack is not None else None, where=source.path,
                               gen_weight=opts.generated_weight)
    return experts_src, residency


def _model_class(source, spec) -> type[MoEModel]:
    cls = MODELS.get(spec.arch)
    if cls is None:
        raise UnsupportedError(source.path, f"the runtime has no forward pass for architecture '{spec.arch}' "
                                          f"(supported: {', '.join(MODELS)})")
    return cls


__all__ = ["MODELS", "MoEModel", "SessionOptions", "StoreOptions", "load_model", "open_store", "plan_store"]
