"""Learning the user's placement from the traffic a run serves, keeping it, and acting on it.

A run with the expert store learns which experts its traffic routes to (``formats.decayed_routing``:
counts per side that fade with a half-life of tokens), writes them beside the model
(``formats.profile_file``: atomically, after requests at most every ``save_every_s`` seconds, at
exit and on SIGTERM) and, between requests, moves the hot set toward them (``plan_swaps_in_place``
with its hysteresis, then ``ExpertStore.apply_swaps``). The next start places experts from the
saved profile, so it starts where the last run stopped.

Where the counts come from: the store reads every call's routing counts anyway (one small copy
after a call, or a host read per layer in async mode); it hands each to ``observe`` with the side
the session set (prompt while a request's prompt runs, generated while decoding). ``observe``
only adds them to a host array (a few microseconds a step); they reach the learner when the side changes
and after each request (``commit``), so learning adds no device sync and almost no host time
per token. Everything here runs in the thread that runs the model (the server's engine thread,
or the one-shot command's), never concurrently with a forward call.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from sparkpack.calibrate.evaluate import min_calibration_tokens
from sparkpack.formats.decayed_routing import DecayedRouting
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.placement import SWAP_MARGIN, plan_swaps_in_place
from sparkpack.formats.profile import SIDES, Profile
from sparkpack.formats.profile_file import ProfileFile

from .options import LearnOptions

if TYPE_CHECKING:
    from .expert_store import ExpertStore

log = logging.getLogger("sparkpack.learning")

# Experts swapped per re-placement step. Each costs its bytes twice over PCIe (the promoted
# expert in, the demoted one out to the host pool): ~3.6 MB for a Q4_K expert of the Qwen3.6
# shape, so a step of 64 is a few milliseconds of PCIe, the longest a request that arrives
# during idle time's steps waits.
SWAP_STEP = 64


@dataclass
class LearningStats:
    """What /metrics shows of the learning (read from another thread: plain numbers only)."""

    requests: int = 0  # requests learned from
    tokens: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SIDES})
    hot_routings: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SIDES})  # served by the hot set
    routings: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SIDES})
    last_cold_rate: dict[str, float | None] = field(default_factory=lambda: {s: None for s in SIDES})
    replacements: int = 0  # re-placement steps applied
    experts_moved: int = 0  # experts promoted (as many were demoted)
    bytes_moved: int = 0  # bytes copied by re-placements (device <-> host)
    replace_seconds: float = 0.0  # wall time of re-placement steps (planning and copies)
    profile_writes: int = 0
    profile_write_failures: int = 0
    last_write: float | None = None  # Unix time of the last write


class LiveLearning:
    """The store's routing observer (``runtime.expert_stats.RoutingObserver``) and the work
    between requests (the server's ``engine.BetweenRequests``): learn, save, re-place.

    ``start``: the profile loaded from ``file`` (``Profile.new`` when there was none).
    ``background``: more work for idle time (a bootstrap replay, ``runtime.server.bootstrap``),
    called with the same ``busy`` test; returns whether any is left."""

    def __init__(self, store: ExpertStore, file: ProfileFile, start: Profile, opts: LearnOptions,
                 gen_weight: float):
        self.store, self.file, self.opts, self.gen_weight = store, file, opts, gen_weight
        self.learner = DecayedRouting(start, opts.half_life_tokens)
        self.stats = LearningStats()
        self.background: Callable[[Callable[[], bool]], bool] | None = None
        self.save_when_idle = False  # tests: rewrite the profile whenever idle (kill -9 lands mid-write)
        self._acc = np.zeros(store.hot.shape, dtype=np.int64)
        self._acc_tokens = 0
        self._acc_side = SIDES[0]
        self._request = {s: [0, 0] for s in SIDES}  # this request's hot and all routings
        self._replace_due = True
        self._units = dict(store.device_layout.units)
        # Before every expert has been routed ~10 times, which ones are busy is mostly chance
        # (calibrate.evaluate): the hot set moves only once the learner has seen that much.
        self.min_tokens = min_calibration_tokens(store.spec.n_expert, store.spec.n_expert_used)
        store.observer = self

    # --- learning (per call) ------------------------------------------------------------------

    def observe(self, counts: np.ndarray, tokens: int, side: str) -> None:
        if side != self._acc_side:
            self.commit()
            self._acc_side = side
        self._acc += counts
        self._acc_tokens += tokens

    def commit(self) -> None:
        """Teach the learner what was observed since the last commit (tokens of one side)."""
        if not self._acc_tokens:
            return
        side, acc = self._acc_side, self._acc
        total, hot = int(acc.sum()), int(acc[self.store.hot].sum())
        self.learner.observe(acc, self._acc_tokens, side)
        st = self.stats
        st.tokens[side] += self._acc_tokens
        st.routings[side] += total
        st.hot_routings[side] += hot
        self._request[side][0] += hot
        self._request[side][1] += total
        acc[:] = 0
        self._acc_tokens = 0

    def scores(self) -> np.ndarray:
        """Expected hits per token of each expert, as learned so far."""
        self.commit()
        return self.learner.scores(self.gen_weight)

    def profile(self) -> Profile:
        """What to save now (everything observed so far included)."""
        self.commit()
        return self.learner.profile()

    # --- between requests ---------------------------------------------------------------------

    def after_request(self, busy: Callable[[], bool]) -> None:
        """A request ended: learn its last counts, save when due, and make one re-placement step
        unless a request is waiting (``busy``): then the steps wait for idle time. Why: an agent
        often sends its next request right after a reply, and a step would lie on its path (after
        a long turn the first step, which also allocates its pinned buffer: issue 42), where a
        coding agent's turns leave idle time for it (its tools run)."""
        self.store.flush()  # a deferred step's counts, or an all-hot store's
        self.commit()
        st = self.stats
        st.requests += 1
        for side, (hot, total) in self._request.items():
            st.last_cold_rate[side] = (total - hot) / total if total else None
        self._request = {s: [0, 0] for s in SIDES}
        self.save_if_due()
        self._replace_due = True
        if not busy():
            self.replace_step()

    def idle(self, busy: Callable[[], bool]) -> bool:
        """Idle time: re-placement steps until the hot set is where the counts say (or a request
        comes), then ``background`` work. Returns whether any work is left."""
        while self._replace_due and not busy():
            self.replace_step()
        if self.background is not None and not busy() and self.background(busy):
            return True
        if self.save_when_idle and not busy():
            self.save()
            return True
        return self._replace_due

    def replace_step(self, n: int = SWAP_STEP) -> int:
        """Swap up to ``n`` experts toward the learned scores; returns how many moved (0: the
        hot set is where the hysteresis keeps it, nothing more to do until the next request)."""
        self.commit()
        if not self._replace_due or self.learner.tokens_seen < self.min_tokens:
            self._replace_due = False
            return 0
        t0 = time.perf_counter()
        swaps = plan_swaps_in_place(self.store.hot, self.scores(), self._units, SWAP_MARGIN, n,
                                    across_layers=self.store.staging is None)
        if not swaps:
            self._replace_due = False
            return 0
        moved = self.store.apply_swaps(swaps)
        st = self.stats
        st.replace_seconds += time.perf_counter() - t0
        st.replacements += 1
        st.experts_moved += len(swaps.promote)
        st.bytes_moved += moved
        return len(swaps.promote)

    def replace_all(self) -> int:
        """Re-place until nothing more moves (before serving: after a bootstrap)."""
        self._replace_due = True
        moved = 0
        while step := self.replace_step():
            moved += step
        return moved

    # --- the profile file ---------------------------------------------------------------------

    def save_if_due(self) -> bool:
        return self.file.due() and self.save()

    def save(self) -> bool:
        """Write the profile now; a failure (disk full, permissions) is counted and logged in
        one line, and learning goes on (the old file is intact: writes are atomic)."""
        try:
            self.file.save(self.profile())
        except (OSError, SparkpackError) as e:
            self.stats.profile_write_failures += 1
            log.warning("could not write the profile %s: %s", self.file.path, getattr(e, "strerror", None) or e)
            return False
        self.stats.profile_writes += 1
        self.stats.last_write = time.time()
        return True

    def close(self) -> bool:
        """At exit (normal, Ctrl-C, SIGTERM): learn what is left and write the profile."""
        self.store.flush()
        return self.save()

    def summary(self) -> str:
        st = self.stats
        return (f"learned from {sum(st.tokens.values())} tokens ({self.learner.tokens_seen:.0f} in the profile), "
                f"{st.experts_moved} experts re-placed; profile {self.file.path}")


def start_learning(model, opts: LearnOptions | None, gen_weight: float) -> LiveLearning | None:
    """The learner of a model loaded with the expert store and a profile file to learn into
    (``runtime.residency.StartProfile``), or None where there is nothing to learn with: no
    store (the CPU path), or learning off (``--no-learn``)."""
    start = model.start_profile
    if opts is None or model.store is None or start is None or start.file is None:
        return None
    return LiveLearning(model.store, start.file, start.loaded, opts, gen_weight)
