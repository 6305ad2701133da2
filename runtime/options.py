"""What a run of a model was asked: one frozen ``RunOptions``, built once from spark-run's flags.

The one-shot run, the chat, the server and ``repack calibrate`` read the same object, so a new
option is one field here and one flag, not a parameter threaded through every caller.
``store_options`` says how it translates into the expert store's ``StoreOptions`` (or none: the
plain CPU path), ``open_model`` opens the model it describes.

Importing this module does not import torch (``spark-run --help`` stays fast).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.memory import PREFILL_CHUNK

from .learn_flags import LearningFlags

if TYPE_CHECKING:
    import torch

    from .generate import Session
    from .models.base import MoEModel
    from .residency import StoreOptions
    from .sampling import Sampler

DEVICES = ("auto", "cpu", "cuda")
# compute dtypes by name; "auto" is bfloat16 on a GPU, float32 on the CPU
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
STREAM_MODES = ("auto", "zerocopy", "async")  # how misses reach the GPU (runtime.expert_store)
DEFAULT_EXPERT_CACHE = 8 * 2**30
# a one-shot run's or the chat's reply without --max-tokens; a served request that sets no cap of
# its own runs to --max-tokens when given, else to the context's end (agents stop at end of turn)
ONE_SHOT_MAX_TOKENS = 256


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class RunOptions:
    """A model, how to hold it, the sessions run on it and how they sample.

    ``device`` is resolved (``cpu`` or ``cuda``) by ``run_options``; the placement fields are the
    store's (``store_options``), None meaning "as the plan decides"."""

    model_path: Path
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None  # torch's CPU threads (None: its default), set by the CLI's main thread
    expert_cache: int = DEFAULT_EXPERT_CACHE  # without the store: bytes of dequantized experts kept
    use_store: bool | None = None  # None: the store on a GPU or when a placement option is given
    vram: int | None = None
    hot_fraction: float | None = None
    cache_slots: int | None = None
    profile: Path | None = None
    stream_mode: str = "auto"
    host_ram: int | None = None  # None: 80% of the memory available (default_host_ram)
    ctx: int = 4096
    kv_type: str = "auto"
    prefill_chunk: int = PREFILL_CHUNK
    max_tokens: int | None = None  # --max-tokens; None: ONE_SHOT_MAX_TOKENS, or a served request's room
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stats_json: Path | None = None
    cache_ram: int | None = None  # the server's conversation cache in host RAM (None: default_cache_ram)
    cache_dir: Path | None = None  # ... and in this folder (None: none)
    learning: LearningFlags = field(default_factory=LearningFlags)  # learn the placement, bootstrap, trace

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunOptions.device must be resolved (cpu or cuda), got {self.device!r}: "
                             "build it with run_options")

    @property
    def reply_tokens(self) -> int:
        """The cap of a one-shot run's or the chat's reply."""
        return self.max_tokens if self.max_tokens is not None else ONE_SHOT_MAX_TOKENS

    @property
    def placement_asked(self) -> bool:
        """Whether any of the store's own options was given."""
        return ((self.vram, self.hot_fraction, self.cache_slots, self.profile, self.host_ram) != (None,) * 5
                or self.stream_mode != "auto" or self.learning.needs_store)


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingOptions))


def run_options(model_path: Path, *, device: str = "auto", **flags: Any) -> RunOptions:
    """The one place flags become a ``RunOptions``: the device resolved, the sampling flags
    gathered into ``SamplingOptions``, the store's options checked against ``--no-store``.
    ``flags`` are RunOptions' and SamplingOptions' field names (a misspelt one is a TypeError);
    any left out keep their defaults."""
    sampling = SamplingOptions(**{name: flags.pop(name) for name in SAMPLING_FIELDS if name in flags})
    opts = RunOptions(model_path, device=resolve_device(device), sampling=sampling, **flags)
    if opts.use_store is False and opts.placement_asked:
        raise SparkpackError(None, "--no-store cannot be combined with the store's options")
    return opts


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


def store_options(opts: RunOptions) -> StoreOptions | None:
    """The expert store's options for this run, or None for the plain path (the CPU default):
    the store runs when asked (``--store``), on a GPU, or when a placement option is given."""
    if not (opts.use_store or (opts.use_store is None and (opts.device == "cuda" or opts.placement_asked))):
        return None
    from .residency import StoreOptions

    host = opts.host_ram if opts.host_ram is not None else default_host_ram()
    return StoreOptions(opts.vram, opts.hot_fraction, opts.cache_slots, opts.profile, opts.stream_mode, host,
                        opts.ctx, kv_type=opts.kv_type, prefill_chunk=opts.prefill_chunk,
                        gen_weight=opts.learning.gen_weight, learn=opts.learning.learn)


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

    store = store_options(opts)
    if store is not None and store.vram is not None and opts.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if store.vram > total:
            raise SparkpackError(None, f"--vram {store.vram / 1024**3:.2f} GiB is more than the GPU has "
                                       f"({total / 1024**3:.2f} GiB)")
        torch.cuda.set_per_process_memory_fraction(store.vram / total)  # the allocator enforces the budget
    return load_model(opts.model_path, device=opts.device, dtype=compute_dtype(opts),
                      expert_cache_bytes=opts.expert_cache, store=store)


def open_session(model: MoEModel, opts: RunOptions, breaks: frozenset[int]) -> Session:
    """A generation session on ``model`` with the run's context, KV cache type and prefill calls;
    ``breaks``: the tokenizer's ``control_ids`` (a one-shot run and a server cut their prompts'
    calls alike, so a served reply has the one-shot bits)."""
    from .generate import Session

    return Session(model, ctx=opts.ctx, kv_type=opts.kv_type, prefill_chunk=opts.prefill_chunk, breaks=breaks)
