"""Where one request's time went beyond the prefill and decode ``Timing`` counts (issue 42).

Why: on the GPU the turn right after a cold long turn took much longer than a plain turn of the
same conversation (BENCHMARKS.md, issue 42), and nothing said whether it waited for what the
previous request left (its state copied out of the device, the conversation cache's writer and
reserve working beside it), for a restore, for its own calls or for the device allocator. Each
engine (serial or ``--parallel``) fills a ``RequestSplit`` per request through a ``SplitClock``;
the OpenAI routes hand it out in ``timings`` (``split_*`` keys beside llama-server's), and
``bench/conversations_bench.py`` prints it per turn.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch


class Background(Protocol):
    """What the split reads of the conversation cache (``ConversationCache``)."""

    def background_seconds(self) -> float: ...

    def copies_running(self) -> bool: ...

    def last_keep(self) -> dict[str, float]: ...


@dataclass
class RequestSplit:
    queue_seconds: float = 0.0  # from arrival to the engine taking it (the previous request's after-work too)
    resume_seconds: float = 0.0  # the conversation cache's lookup and restore (``prepare``)
    prompt_seconds: float = 0.0  # ``Session.prompt``: checkpoints restored, the calls, the device's wait
    first_token_seconds: float = 0.0  # from the prompt's logits to the first token read on the host
    rest_seconds: float = 0.0  # from the first token to the end of the computation (the other tokens)
    background_seconds: float = 0.0  # the cache's writer and reserve thread working while it computed
    copies_running: bool = False  # the previous request's state was still being copied out when it began
    # the engine's seconds in the previous request's state snapshot, by phase
    # (``ConversationCache.last_keep``): what a request arriving right after it queued behind
    previous_keep: dict[str, float] = field(default_factory=dict)
    # the engine's seconds after the previous request's last token, by step (``Engine.after_work``:
    # sink, cache, metrics, between), all of which a request right behind it waited for
    previous_after: dict[str, float] = field(default_factory=dict)
    device_allocs: int = 0  # device allocations torch's allocator made (cudaMalloc) while it computed
    alloc_retries: int = 0  # allocations that had to free the allocator's cached blocks and retry
    streamed_bytes: int = 0  # expert bytes the store moved host to device for it (copies, staging, zero-copy)
    compiled: list[str] = field(default_factory=list)  # Triton kernels compiled (or loaded) on its path

    def timings(self) -> dict:
        """The ``split_*`` keys of a response's ``timings``: milliseconds (the previous snapshot's
        by phase, a dict), counts, a flag and the kernels compiled (a list of names)."""
        out = {}
        for k, v in asdict(self).items():
            if k.endswith("_seconds"):
                out["split_" + k.removesuffix("_seconds") + "_ms"] = v * 1e3
            elif k.startswith("previous_"):
                out[f"split_{k}_ms"] = {phase: s * 1e3 for phase, s in v.items()}
            else:
                out["split_" + k] = v
        return out


class Compiles:
    """The Triton kernels this process compiled (or loaded from Triton's disk cache), by name,
    seen through Triton's compile hook when no one else holds it. Why: the warm-up runs every
    call shape so that no request compiles one; a shape it missed costs the request that meets
    it first (which the next ones then do not pay)."""

    names: list[str] = []
    _lock = threading.Lock()
    _on = False

    @classmethod
    def watch(cls) -> None:
        """Hold Triton's compile hook from now on (Triton 3.4 and later: ``triton.knobs``; with an
        older Triton, which pyproject allows, the list stays empty)."""
        try:
            from triton import knobs
        except ImportError:
            return
        with cls._lock:
            if not cls._on and knobs.runtime.jit_cache_hook is None:
                knobs.runtime.jit_cache_hook = cls._seen
                cls._on = True

    @classmethod
    def _seen(cls, *, fn, **_) -> None:
        cls.names.append(fn.name)  # None: Triton compiles it


class SplitClock:
    """Times one request's phases in the engine thread: ``mark(phase)`` ends a phase (the time
    since the last mark goes to ``RequestSplit.<phase>_seconds``), ``end`` adds what ran beside.
    ``after``: the engine's work after the previous request, by step (``Engine.after_work``)."""

    def __init__(self, background: Background | None, store, device: torch.device, arrived: float,
                 after: dict[str, float] | None = None):
        self.split = RequestSplit()
        self.store = store  # the model's expert store (None: none)
        self.background = background
        self.device, self.cuda = device, device.type == "cuda"
        self._bg0 = background.background_seconds() if background is not None else 0.0
        if background is not None:
            self.split.copies_running = background.copies_running()
            self.split.previous_keep = background.last_keep()
        self.split.previous_after = dict(after or {})
        self._mem0 = self._allocs()
        if self.cuda:
            Compiles.watch()
        self._compiled0 = len(Compiles.names)
        self._streamed0 = self._streamed()
        self._last = time.perf_counter()
        self.split.queue_seconds = self._last - arrived

    def _allocs(self) -> tuple[int, int]:
        if not self.cuda:
            return 0, 0
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    def _streamed(self) -> int:
        return self.store.stats.bytes_streamed if self.store is not None else 0

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        setattr(self.split, phase + "_seconds", now - self._last)
        self._last = now

    def end(self) -> RequestSplit:
        self.mark("rest")
        if self.background is not None:
            self.split.background_seconds = self.background.background_seconds() - self._bg0
        allocs, retries = self._allocs()
        self.split.device_allocs, self.split.alloc_retries = allocs - self._mem0[0], retries - self._mem0[1]
        self.split.compiled = Compiles.names[self._compiled0:]
        self.split.streamed_bytes = self._streamed() - self._streamed0
        return self.split
