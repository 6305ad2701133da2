"""What a run of a model was asked: one frozen tree of settings, translated once from spark-run's
flags (``run_options``) and read by each layer directly.

::

    RunOptions                 the model file, device, dtype, threads, stats
    ├── store: StoreOptions    the expert store (None: the plain path); read by runtime.residency,
    │   └── learn              runtime.models and runtime.learning; LearnOptions (None: --no-learn)
    ├── session: SessionOptions  every Session on the model: context, KV type, prompt calls
    ├── sampling: SamplingOptions  a one-shot run's sampling, a server's request defaults
    ├── draft: DraftOptions    speculative decoding (--draft, --draft-tokens)
    ├── learning: LearningFlags  around the learner: bootstrap replay, routing trace
    └── serve: ServeOptions    the HTTP server (None: a one-shot run or the chat)

A field keeps its flag's name (``--miss-mode`` is ``store.miss_mode``; ``LearnOptions`` names
its units: ``--half-life`` is ``half_life_tokens``, ``--profile-save-every`` ``save_every_s``), so
an option is one flag and one field, not a parameter threaded and renamed through every caller.
Every dataclass is keyword-only. The planner's inputs (``formats.placement.Budget``, ``formats.memory.MemoryTarget``)
are formats' own, derived from this tree where the store plans (``runtime.residency``), because
``repack split`` plans with them too.

Importing this module does not import torch (``spark-run --help`` stays fast).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkpack.formats.decayed_routing import HALF_LIFE_TOKENS
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.memory import PREFILL_CHUNK, PREFILL_GRAPH_TOKENS, STAGE_TOKENS
from sparkpack.formats.placement import GEN_WEIGHT, Budget
from sparkpack.formats.profile_file import SAVE_EVERY_S

if TYPE_CHECKING:
    import torch

    from .generate import Session
    from .models.base import MoEModel
    from .sampling import Sampler

DEVICES = ("auto", "cpu", "cuda")
# compute dtypes by name; "auto" is bfloat16 on a GPU, float32 on the CPU
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
MISS_MODES = ("auto", "zerocopy", "async")  # how a cold expert's bytes reach the GPU (runtime.expert_store)
DEFAULT_DEQUANT_LIMIT = 8 * 2**30
# a one-shot run's or the chat's reply without --max-tokens; a served request that sets no cap of
# its own runs to --max-tokens when given, else to the context's end (agents stop at end of turn)
ONE_SHOT_MAX_TOKENS = 256
# Requests a server keeps in flight, decoded together (--parallel): agents overlap requests (a
# subagent, a side request beside the main turn), and llama-server keeps 4 slots by default too.
DEFAULT_PARALLEL = 4
# Prompt tokens a --parallel server prefills per decode step (--step-tokens): one captured call's
# (why: runtime.server.parallel).
DEFAULT_STEP_TOKENS = PREFILL_GRAPH_TOKENS


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How tokens are drawn: spark-run's sampling flags, the server's defaults, one request's choice."""

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def sampler(self, prompt_len: int) -> Sampler | None:
        """None (argmax on the device, the greedy path) for temperature 0 without penalties."""
        from .sampling import Sampler

        penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1.0, 0.0, 0.0)
        if self.temperature <= 0 and not penalties:
            return None
        return Sampler(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                       repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty, seed=self.seed, prompt_len=prompt_len)


DRAFT_KINDS = ("off", "ngram", "mtp")  # --draft: what drafts tokens for a verify step (runtime.drafting)
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16  # a verify step's rows stay far below a sliding-window ring's spare rows


@dataclass(frozen=True, kw_only=True)
class DraftOptions:
    """Speculative decoding (``runtime.speculative``): the drafter (``kind``, one of
    ``DRAFT_KINDS``; ``off``: plain decoding) and the most tokens it drafts for one verify step
    (the length then follows the acceptance: ``runtime.drafting.DraftLength``)."""

    kind: str = "off"
    tokens: int = DEFAULT_DRAFT_TOKENS


@dataclass(frozen=True, kw_only=True)
class LearnOptions:
    """Learning the placement from the run's traffic (README, "Gets faster the more you use it")."""

    half_life_tokens: float = HALF_LIFE_TOKENS
    save_every_s: float = SAVE_EVERY_S  # 0: after every request
    force: bool = False  # replace a file that is not this model's profile


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """The tiered expert store: its budget, where misses come from, the profile it places with
    and learns into. None of a field means "as the plan decides"."""

    vram: int | None = None
    hot_fraction: float | None = None
    cache_slots: int | None = None
    profile: Path | None = None
    miss_mode: str = "auto"  # MISS_MODES
    host_ram: int | None = None  # pinned host bytes for cold experts (None: no limit)
    # calls of at least this many tokens stage their cold experts in bulk (runtime.expert_staging);
    # None: never (every call reads them zero-copy)
    stage_tokens: int | None = STAGE_TOKENS
    generated_weight: float = GEN_WEIGHT  # weight of generated-side routings when placing from a profile
    learn: LearnOptions | None = None  # learn into the profile file (None: read it only)
    mtp: bool = False  # load the file's multi-token-prediction head too (drafting); the plan counts it
    draft_tokens: int = 0  # the session drafts up to this many tokens a step (--draft): the plan counts their states

    @property
    def budget(self) -> Budget:
        return Budget(self.vram, self.hot_fraction, self.cache_slots)


@dataclass(frozen=True, kw_only=True)
class SessionOptions:
    """How every generation session on the model is opened; a ``--vram`` plan reserves for them."""

    ctx: int = 4096
    kv_type: str = "auto"  # KV cache element type (runtime.cache.KV_TYPES)
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per forward call (their temporaries are planned for)
    sequences: int = 1  # sessions open at once (a server's --parallel): the plan holds each one's KV cache


@dataclass(frozen=True, kw_only=True)
class LearningFlags:
    """What a run does around its learner: replay past sessions first, record every routing."""

    bootstrap: str | None = None  # a path, or "auto" (needs --serve)
    bootstrap_background: bool = False
    trace_out: Path | None = None


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """The HTTP server: where it listens, its key, the conversation cache it keeps."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cache_ram: int | None = None  # conversation states in host RAM (None: default_cache_ram)
    cache_dir: Path | None = None  # ... and in this folder (None: none)
    parallel: int = DEFAULT_PARALLEL  # requests decoded together (``server.parallel.ParallelEngine``); 1: ``server.engine.Engine``
    step_tokens: int = DEFAULT_STEP_TOKENS  # prompt tokens prefilled per decode step (0: a prompt whole)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """A model, how to hold it, the sessions run on it and how they sample.

    ``device`` is resolved (``cpu`` or ``cuda``) by ``run_options``, and so is whether the store
    runs (``store``)."""

    model_path: Path
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None  # torch's CPU threads (None: its default), set by the CLI's main thread
    dequant_limit: int = DEFAULT_DEQUANT_LIMIT  # without the store: bytes of dequantized experts kept (LRU)
    store: StoreOptions | None = None
    session: SessionOptions = field(default_factory=SessionOptions)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    draft: DraftOptions = field(default_factory=DraftOptions)
    max_tokens: int | None = None  # --max-tokens; None: ONE_SHOT_MAX_TOKENS, or a served request's room
    learning: LearningFlags = field(default_factory=LearningFlags)
    serve: ServeOptions | None = None
    stats_json: Path | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunOptions.device must be resolved (cpu or cuda), got {self.device!r}: "
                             "build it with run_options")

    @property
    def reply_tokens(self) -> int:
        """The cap of a one-shot run's or the chat's reply."""
        return self.max_tokens if self.max_tokens is not None else ONE_SHOT_MAX_TOKENS


def run_options(model_path: Path, *, device: str = "auto", dtype: str = "auto", threads: int | None = None,
                dequant_limit: int = DEFAULT_DEQUANT_LIMIT, use_store: bool | None = None,
                vram: int | None = None, hot_fraction: float | None = None, cache_slots: int | None = None,
                profile: Path | None = None, miss_mode: str = "auto", host_ram: int | None = None,
                ctx: int = 4096, kv_type: str = "auto", prefill_chunk: int = PREFILL_CHUNK,
                max_tokens: int | None = None, stats_json: Path | None = None,
                no_learn: bool = False, force: bool = False, half_life: float = HALF_LIFE_TOKENS,
                generated_weight: float = GEN_WEIGHT, profile_save_every: float = SAVE_EVERY_S,
                bootstrap: str | None = None, bootstrap_background: bool = False, trace_out: Path | None = None,
                serve: bool = False, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
                api_key_file: Path | None = None, cache_ram: int | None = None, cache_dir: Path | None = None,
                parallel: int | None = None, step_tokens: int | None = None, draft: str = "off", draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                **sampling: Any) -> RunOptions:
    """The one place flags become a ``RunOptions``: keyword arguments named as click names
    spark-run's flags (a misspelt one is a TypeError), any left out at the flag's default. The
    device is resolved, the store turned on where it runs (asked with ``--store``, on a GPU, or
    when one of its options is given), and combinations that cannot work refused in one line."""
    learning = LearningFlags(bootstrap=bootstrap, bootstrap_background=bootstrap_background, trace_out=trace_out)
    if bootstrap is not None and not serve:
        raise SparkpackError(None, "--bootstrap replays past sessions before serving: it needs --serve")
    if bootstrap is not None and no_learn:
        raise SparkpackError(None, "--bootstrap teaches the placement: it cannot be combined with --no-learn")
    if bootstrap_background and bootstrap is None:
        raise SparkpackError(None, "--bootstrap-background needs --bootstrap PATH|auto")
    if not serve and (cache_ram is not None or cache_dir is not None):
        raise SparkpackError(None, "--cache-ram and --cache-dir keep a server's conversations: use them with --serve")
    if not serve and parallel is not None:
        raise SparkpackError(None, "--parallel is the number of requests a server decodes together: use it with --serve")
    if not serve and step_tokens is not None:
        raise SparkpackError(None, "--step-tokens is the prompt tokens a server prefills per decode step: use it with --serve")
    if draft not in DRAFT_KINDS:
        raise SparkpackError(None, f"--draft must be one of {', '.join(DRAFT_KINDS)}, got {draft!r}")
    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise SparkpackError(None, f"--draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, got {draft_tokens}")
    if draft != "off" and parallel not in (None, 1):
        raise SparkpackError(None, "--draft drafts for one sequence at a time: it cannot be combined with --parallel")
    # a drafting server holds one sequence (the drafts verify one sequence's tokens)
    parallel = parallel if parallel is not None else (1 if draft != "off" else DEFAULT_PARALLEL)
    if step_tokens is not None and parallel == 1:
        raise SparkpackError(None, "--step-tokens interleaves a prompt with other requests' decode steps: "
                                   "it needs --parallel 2 or more")
    device = resolve_device(device)
    store_asked = ((vram, hot_fraction, cache_slots, profile, host_ram) != (None,) * 5 or miss_mode != "auto"
                   or bootstrap is not None or trace_out is not None)  # (only the store sees the routings)
    if use_store is False and store_asked:
        raise SparkpackError(None, "--no-store cannot be combined with the store's options")
    store = None
    if use_store or (use_store is None and (device == "cuda" or store_asked)):
        learn = None if no_learn else LearnOptions(half_life_tokens=half_life, save_every_s=profile_save_every,
                                                   force=force)
        store = StoreOptions(vram=vram, hot_fraction=hot_fraction, cache_slots=cache_slots, profile=profile,
                             miss_mode=miss_mode, host_ram=host_ram if host_ram is not None else default_host_ram(),
                             generated_weight=generated_weight, learn=learn, mtp=draft == "mtp",
                             draft_tokens=draft_tokens if draft != "off" else 0)
    return RunOptions(model_path=model_path, device=device, dtype=dtype, threads=threads, dequant_limit=dequant_limit,
                      store=store, session=SessionOptions(ctx=ctx, kv_type=kv_type, prefill_chunk=prefill_chunk,
                                             sequences=parallel if serve else 1),
                      sampling=SamplingOptions(**sampling), draft=DraftOptions(kind=draft, tokens=draft_tokens),
                      max_tokens=max_tokens, learning=learning,
                      serve=serve_options(host=host, port=port, api_key=api_key, api_key_file=api_key_file,
                                          cache_ram=cache_ram, cache_dir=cache_dir, parallel=parallel,
                                          step_tokens=DEFAULT_STEP_TOKENS if step_tokens is None else step_tokens)
                      if serve else None,
                      stats_json=stats_json)


def serve_options(*, host: str, port: int, api_key: str | None, api_key_file: Path | None,
                  cache_ram: int | None, cache_dir: Path | None, parallel: int = DEFAULT_PARALLEL,
                  step_tokens: int = DEFAULT_STEP_TOKENS) -> ServeOptions:
    """The --serve flags as ``ServeOptions`` (the key read from its file)."""
    if api_key is not None and api_key_file is not None:
        raise SparkpackError(None, "give either --api-key or --api-key-file, not both")
    if api_key_file is not None:
        api_key = api_key_file.read_text(encoding="utf-8").strip()
        if not api_key:
            raise SparkpackError(api_key_file, "is empty: it should hold the API key")
    return ServeOptions(host=host, port=port, api_key=api_key, cache_ram=cache_ram, cache_dir=cache_dir,
                        parallel=parallel, step_tokens=step_tokens)


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when a GPU is present; ``cuda`` without one is a one-line error."""
    import torch

    if device not in DEVICES:
        raise SparkpackError(None, f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SparkpackError(None, "--device cuda: no CUDA device is available (use --device cpu)")
    return device


def compute_dtype(opts: RunOptions) -> torch.dtype:
    """The dtype activations are computed in (``auto``: bfloat16 on a GPU, float32 on the CPU)."""
    import torch

    table = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
             "float16": torch.float16}
    name = opts.dtype if opts.dtype != "auto" else ("bfloat16" if opts.device == "cuda" else "float32")
    if name not in table:
        raise SparkpackError(None, f"--dtype must be one of {', '.join(DTYPES)}, got {opts.dtype!r}")
    return table[name]


def default_host_ram() -> int | None:
    """80% of the memory the OS reports available (None where it does not say)."""
    avail = available_ram()
    return None if avail is None else int(avail * 0.8)


def available_ram() -> int | None:
    """The memory the OS reports available (``MemAvailable``; None where it does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_cache_ram(cap: int) -> int:
    """The conversation cache's host RAM when ``--cache-ram`` is not given: ``cap``, or half of
    what is still available once the model (and the expert store's pinned pool) is loaded, if
    that is less: the states must not push the pool out of RAM."""
    avail = available_ram()
    return cap if avail is None else max(0, min(cap, avail // 2))


def open_model(opts: RunOptions) -> MoEModel:
    """The runtime model ``opts`` describes, from a .gguf file or a .sparkpack directory; on a GPU
    ``--vram`` also caps what torch's allocator may take."""
    import torch

    from .models import load_model

    store = opts.store
    if store is not None and store.vram is not None and opts.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if store.vram > total:
            raise SparkpackError(None, f"--vram {store.vram / 1024**3:.2f} GiB is more than the GPU has "
                                       f"({total / 1024**3:.2f} GiB)")
        torch.cuda.set_per_process_memory_fraction(store.vram / total)  # the allocator enforces the budget
    return load_model(opts.model_path, device=opts.device, dtype=compute_dtype(opts),
                      dequant_limit=opts.dequant_limit, store=store, session=opts.session)


def open_session(model: MoEModel, opts: SessionOptions, breaks: frozenset[int],
                 draft: DraftOptions | None = None) -> Session:
    """A generation session on ``model`` with the run's context, KV cache type and prefill calls;
    ``breaks``: the tokenizer's ``control_ids`` (a one-shot run and a server cut their prompts'
    calls alike, so a served reply has the one-shot bits); ``draft``: its drafter, if any."""
    from .generate import Session

    session = Session(model, ctx=opts.ctx, kv_type=opts.kv_type, prefill_chunk=opts.prefill_chunk, breaks=breaks)
    if draft is not None and draft.kind != "off":
        from .speculative import Speculation

        session.draft = Speculation(open_drafter(model, draft.kind), draft.tokens)
    return session


def open_drafter(model: MoEModel, kind: str):
    """The drafter ``--draft`` names (``runtime.drafting.Drafter``); ``mtp`` needs a file with the
    head (``repack inspect`` says) and the head's drafter (``runtime.models.mtp.MtpDrafter``)."""
    if kind == "ngram":
        from .drafting import NgramDrafter

        return NgramDrafter()
    if model.spec.nextn is None:
        raise SparkpackError(model.gguf.path, "has no multi-token-prediction head (nextn tensors): --draft mtp "
                                              "needs one; --draft ngram drafts without weights")
    from .models.mtp import MtpDrafter

    return MtpDrafter(model)
