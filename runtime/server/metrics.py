"""Prometheus metrics of the server (``GET /metrics``).

One registry per server (tests start several in one process), every metric declared once in
``ServerMetrics``: a new one is a line there plus the line that updates it. The engine thread
calls ``observe_job`` after each request; the expert store's counters are read as differences
since the last request, so they cover exactly the served traffic. What the placement learning
did (``runtime.learning.LearningStats``: routings on hot and cold experts per side, re-placements,
profile writes) is read when /metrics is asked, by ``LearningCollector``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..learning import LearningStats
from .engine import Job, Outcome

PREFIX = "sparkpack_"
# tokens/s buckets spanning a CPU test model to a GPU prefill
RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 300, 500, 1000, 2000, 4000, 8000, 16000)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
# the expert store's counters exported as routings by where they were served
STORE_ROUTINGS = {"hot": "hot_hits", "cached": "cache_hits", "missed": "misses"}

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # the *_created series say when the process started, for every metric


class ServerMetrics:
    def __init__(self, model=None, learning: LearningStats | None = None, sessions: list | None = None):
        self.model = model
        self.sessions = sessions or []  # (their state checkpoints' host memory, read in the engine thread)
        r = self.registry = CollectorRegistry()
        if learning is not None:
            r.register(LearningCollector(learning))
        self.requests = Counter(PREFIX + "requests", "Requests by route and outcome", ["route", "outcome"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of generation requests", registry=r)
        self.cached_tokens = Counter(PREFIX + "prefix_cache_hit_tokens",
                                     "Prompt tokens kept from the previous request (not computed again)", registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "From arrival (queue included) to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(PREFIX + "queue_wait_seconds", "Time a request waited for the engine",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_rate = Histogram(PREFIX + "prefill_tokens_per_second", "Prompt tokens computed per second, per request",
                                      buckets=RATE_BUCKETS, registry=r)
        self.decode_rate = Histogram(PREFIX + "decode_tokens_per_second", "Generated tokens per second, per request",
                                     buckets=RATE_BUCKETS, registry=r)
        self.waiting = Gauge(PREFIX + "requests_waiting", "Requests queued behind the running one", registry=r)
        self.routings = Counter(PREFIX + "expert_routings", "Expert routings by where the expert was served",
                                ["served"], registry=r)
        self.routed_tokens = Counter(PREFIX + "expert_routed_tokens",
                                     "Tokens through the MoE layers (routings / this = per token)", registry=r)
        self.per_token = Gauge(PREFIX + "expert_routings_per_token", "The last request's routings per token, by "
                               "where the expert was served", ["served"], registry=r)
        self.share = Gauge(PREFIX + "expert_routing_share", "The last request's share of routings by where the "
                           "expert was served (missed: the miss rate)", ["served"], registry=r)
        self.bytes_streamed = Counter(PREFIX + "expert_bytes_streamed", "Host-to-GPU expert bytes", registry=r)
        self.vram_peak = Gauge(PREFIX + "vram_peak_bytes", "Peak GPU memory allocated by the process", registry=r)
        host = Gauge(PREFIX + "expert_host_bytes", "Host memory the expert store's cold experts take at most "
                     "(0: every expert on the device)", registry=r)
        host.set(model.store.describe()["host_pool_bytes"] if model is not None and model.store is not None else 0)
        self.checkpoint_bytes = Gauge(PREFIX + "state_checkpoint_host_bytes", "Host memory the sessions' state "
                                      "checkpoints take (DeltaNet states, sliding windows)", registry=r)
        self.observe_checkpoints()
        self._store_seen: dict[str, int] = self._store_counts()  # loading's own reads are not traffic
        self.conversations = None  # a runtime.conversation_cache.ConversationCache, read at scrape time
        r.register(ConversationCollector(self))
        self.draft = None  # the session's runtime.speculative.Speculation (--draft), read at scrape time
        r.register(DraftCollector(self))

    def observe_checkpoints(self) -> None:
        """Called in the engine thread (a session's copies change only there)."""
        self.checkpoint_bytes.set(sum(s.checkpoint_bytes for s in self.sessions))

    def observe_job(self, job: Job, outcome: Outcome) -> None:
        self.observe_checkpoints()
        if outcome.finish == "error":
            return
        self.queue_wait.observe(outcome.queued_seconds)
        if outcome.finish == "cancelled" and outcome.completion_tokens == 0 and outcome.prefill_seconds == 0:
            return  # cancelled in the queue: nothing was computed
        self.prompt_tokens.inc(outcome.prompt_tokens)
        self.cached_tokens.inc(outcome.cached_tokens)
        self.generated_tokens.inc(outcome.completion_tokens)
        if outcome.first_token_seconds is not None:
            self.ttft.observe(outcome.first_token_seconds)
        computed = outcome.prompt_tokens - outcome.cached_tokens
        if outcome.prefill_seconds > 0 and computed > 1:
            self.prefill_rate.observe(computed / outcome.prefill_seconds)
        if outcome.decode_seconds > 0 and outcome.completion_tokens > 1:
            self.decode_rate.observe((outcome.completion_tokens - 1) / outcome.decode_seconds)
        self.observe_store()

    def _store_counts(self) -> dict[str, int]:
        """The expert store's counters now (empty without a store: the CPU path has none)."""
        model = self.model
        if model is None or model.store is None:
            return {}
        model.store.flush()  # counts still on the device, or a deferred step's (the engine's thread)
        counts = dataclasses.asdict(model.store.stats)
        return {name: int(counts[name]) for name in (*STORE_ROUTINGS.values(), "tokens", "bytes_streamed")}

    def observe_store(self) -> None:
        """Add what the expert store counted since the last call."""
        now = self._store_counts()
        if not now:
            return
        model = self.model
        delta = {k: v - self._store_seen.get(k, 0) for k, v in now.items()}
        self._store_seen = now
        routed = sum(max(delta[name], 0) for name in STORE_ROUTINGS.values())
        for label, name in STORE_ROUTINGS.items():
            self.routings.labels(served=label).inc(max(delta[name], 0))
            if delta["tokens"] > 0:
                self.per_token.labels(served=label).set(delta[name] / delta["tokens"])
            if routed > 0:
                self.share.labels(served=label).set(delta[name] / routed)
        self.routed_tokens.inc(max(delta["tokens"], 0))
        self.bytes_streamed.inc(max(delta["bytes_streamed"], 0))
        if model.device.type == "cuda":
            import torch

            self.vram_peak.set(torch.cuda.max_memory_allocated(model.device))

    def forget_store_traffic(self) -> None:
        """What the store counted since the last request was no served traffic (a background
        bootstrap): the next request's differences start from now."""
        self._store_seen = self._store_counts()

    def render(self, waiting: int) -> bytes:
        self.waiting.set(waiting)
        return generate_latest(self.registry)


class LearningCollector:
    """The placement learning's numbers at scrape time (they change in the engine thread)."""

    def __init__(self, stats: LearningStats):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self.stats
        tokens = CounterMetricFamily(PREFIX + "learned_tokens", "Tokens the placement learned from, by side",
                                     labels=["side"])
        routings = CounterMetricFamily(PREFIX + "learned_routings", "Routings the placement learned from, by side "
                                       "and whether the expert was in the hot set then", labels=["side", "placement"])
        cold = GaugeMetricFamily(PREFIX + "cold_hit_rate", "The last request's share of routings on experts outside "
                                 "the hot set (cache slots not counted), by side", labels=["side"])
        for side in st.tokens:
            tokens.add_metric([side], st.tokens[side])
            routings.add_metric([side, "hot"], st.hot_routings[side])
            routings.add_metric([side, "cold"], st.routings[side] - st.hot_routings[side])
            if st.last_cold_rate[side] is not None:
                cold.add_metric([side], st.last_cold_rate[side])
        yield from (tokens, routings, cold)
        yield _counter("learned_requests", "Requests the placement learned from", st.requests)
        yield _counter("replacements", "Re-placement steps applied between requests", st.replacements)
        yield _counter("replaced_experts", "Experts moved into the hot set by re-placement (as many moved out)",
                       st.experts_moved)
        yield _counter("replaced_bytes", "Bytes copied by re-placement (device and host)", st.bytes_moved)
        yield _counter("replacement_seconds", "Time the engine spent re-placing (planning and copies)",
                       st.replace_seconds)
        yield _counter("profile_writes", "Profile files written", st.profile_writes)
        yield _counter("profile_write_failures", "Profile writes that failed (the old file stays)",
                       st.profile_write_failures)
        if st.last_write is not None:
            yield GaugeMetricFamily(PREFIX + "profile_last_write_timestamp_seconds", "When the profile was last written "
                                    "(Unix time)", value=st.last_write)


class ConversationCollector:
    """The conversation cache's numbers at scrape time (``runtime.conversation_cache.CacheStats``)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        cache = self.metrics.conversations
        if cache is None:
            return
        entries = GaugeMetricFamily(PREFIX + "conversation_cache_entries", "Conversation states kept, by tier",
                                    labels=["tier"])
        size = GaugeMetricFamily(PREFIX + "conversation_cache_bytes", "Bytes of conversation states kept, by tier",
                                 labels=["tier"])
        for tier, (n, nbytes) in cache.tier_counts().items():
            entries.add_metric([tier], n)
            size.add_metric([tier], nbytes)
        st = cache.stats
        lookups = CounterMetricFamily(PREFIX + "conversation_cache_requests", "Requests by where their kept prefix "
                                      "came from: an entry (hit), the live sequence, nothing (miss)", labels=["result"])
        for result, n in (("hit", st.hits), ("live", st.live), ("miss", st.misses)):
            lookups.add_metric([result], n)
        yield from (entries, size, lookups)
        yield _counter("conversation_cache_evictions", "Entries pushed out of the host tier", st.evictions)
        yield _counter("conversation_cache_restore_seconds", "Time spent putting entries back into the GPU cache",
                       st.restore_seconds)
        yield _counter("conversation_cache_ignored_files", "Cache files ignored (corrupt, truncated, not ours)",
                       st.ignored_files)


class DraftCollector:
    """Speculative decoding's numbers at scrape time (``runtime.drafting.DraftStats``), when the
    server drafts (``--draft``): acceptance is ``accepted / drafted``."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        spec = self.metrics.draft
        if spec is None:
            return
        st = spec.stats
        yield _counter("draft_verify_steps", "Verify steps (the picked token and its drafts in one step)",
                       st.verify_steps)
        yield _counter("draft_tokens_drafted", "Tokens the drafter proposed", st.drafted)
        yield _counter("draft_tokens_accepted", "Drafted tokens the model kept", st.accepted)
        yield GaugeMetricFamily(PREFIX + "draft_length", "Tokens the drafter is asked for next (adapts to "
                                "the acceptance, up to --draft-tokens)", value=st.k)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)
