"""What a run says about itself on stderr: where its experts sit once loaded, and its numbers
at the end (``--stats-json`` writes them too), and what a server says while it starts and stops
(``ServerReport``). The CLI, the server and calibration wire a run; the lines it prints are
written here.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from sparkpack.formats.atomic_file import write_atomic
from sparkpack.formats.units import fmt_size


def report_residency(model) -> None:
    r, st = model.residency, model.store
    d = st.describe()
    line = f"experts: {d['hot_experts']}/{d['experts']} hot ({d['hot_fraction']:.0%}, {r.source})"
    if d["host_tier"] == "none":  # nothing is cold: no misses, no host tier
        line += ", none cold"
    else:
        held = fmt_size(d["host_pool_bytes"])
        cold = (f"cold experts read from disk (a {held} cache in host RAM)" if d["host_tier"] == "disk" else
                f"cold experts in {'pinned ' if d['host_pinned'] else ''}host RAM ({held})")
        line += f", {d['cache_slots']} cache slots, misses via {d['mode']}, {cold}"
        if d["staging_bytes"]:  # runtime.expert_staging
            line += f", calls of {d['stage_tokens']}+ tokens staged (2 x {d['staging_bytes'] / 2 / 1024**2:.0f} MiB)"
    if r.expected_cold_rate is not None:
        line += f", expected cold-hit rate {r.expected_cold_rate:.1%}"
    click.echo(line, err=True)


def collect_stats(model, session) -> dict:
    """The run's numbers: speed, where routings were served, bytes streamed, memory peak."""
    import torch

    t = session.timing
    out = {"prefill_tokens": t.prefill_tokens, "prefill_seconds": t.prefill_seconds,
           "prefill_tok_s": t.prefill_tokens / t.prefill_seconds if t.prefill_seconds else None,
           "decode_tokens": t.decode_tokens, "decode_seconds": t.decode_seconds,
           "decode_tok_s": t.decode_tokens / t.decode_seconds if t.decode_seconds else None,
           "graph_capture_seconds": t.capture_seconds, "cpu_threads": torch.get_num_threads()}
    store = model.store
    if store is not None:
        store.flush()  # counts still on the device, or a deferred step's
        s = store.stats.as_json()
        out["store"] = {**store.describe(), **s}
        busy = t.prefill_seconds + t.decode_seconds + t.capture_seconds
        out["store"]["stream_gb_s"] = s["bytes_streamed"] / busy / 1e9 if busy else None
        out["residency"] = model.residency.as_json()
    if session.draft is not None:
        out["draft"] = {"drafter": session.draft.drafter.name, **session.draft.stats.as_json()}
    if model.device.type == "cuda":
        out["vram_peak_allocated"] = torch.cuda.max_memory_allocated()
        out["vram_peak_reserved"] = torch.cuda.max_memory_reserved()
    return out


def report_stats(model, session, stats_json: Path | None) -> None:
    s = collect_stats(model, session)
    parts = []
    if s["prefill_tok_s"]:
        parts.append(f"prefill {s['prefill_tokens']} tok at {s['prefill_tok_s']:.1f} tok/s")
    if s["decode_tok_s"]:
        parts.append(f"decode {s['decode_tokens']} tok at {s['decode_tok_s']:.1f} tok/s")
    if s["graph_capture_seconds"]:
        parts.append(f"CUDA graph captured in {s['graph_capture_seconds']:.2f} s")
    d = s.get("draft")
    if d and d["verify_steps"]:
        parts.append(f"drafts ({d['drafter']}): {d['accepted']}/{d['drafted']} kept"
                     + (f" ({d['acceptance']:.0%})" if d["acceptance"] is not None else "")
                     + f", {d['tokens_per_verify']:.2f} tokens per verify step, draft length {d['k']}")
    st = s.get("store")
    if st:
        parts.append(f"per token: {st['hot_hits_per_token']:.1f} hot, {st['cache_hits_per_token']:.1f} cached, "
                     f"{st['misses_per_token']:.1f} missed; {st['bytes_streamed'] / 1e9:.2f} GB streamed"
                     + (f" at {st['stream_gb_s']:.1f} GB/s" if st.get("stream_gb_s") else ""))
    if "vram_peak_reserved" in s:
        parts.append(f"VRAM peak {s['vram_peak_allocated'] / 1024**3:.2f} GiB allocated, "
                     f"{s['vram_peak_reserved'] / 1024**3:.2f} GiB reserved")
    if parts:
        click.echo("[" + "; ".join(parts) + "]", err=True)
    if stats_json is not None:
        import json

        write_atomic(stats_json, json.dumps(s, indent=1) + "\n")


class ServerReport:
    """What ``spark-run --serve`` says while it starts and stops, one method per event with the
    facts it needs and the line's wording here: stderr, but the client settings (which users
    copy and scripts read) on stdout. Why: the server's composition root
    (``runtime.server.serve``) wires and reports facts; the words a user reads are in one place."""

    def say(self, line: str) -> None:
        click.echo(f"sparkpack: {line}", err=True)

    def warn(self, line: str) -> None:
        click.echo(f"warning: {line}", err=True)

    def loading(self, model_path: Path, base: str) -> None:
        self.say(f"loading {model_path} (listening on {base}, /health answers 503 until ready)")

    def ready(self, settings: str) -> None:
        click.echo(settings)
        sys.stdout.flush()

    def warmed_up(self, seconds: float) -> None:
        self.say(f"warmed up in {seconds:.2f} s")

    def state_checkpoints(self, sessions: int, nbytes: int) -> None:
        """The host memory the sessions' state checkpoints hold (``StateCheckpoints.reserve``):
        beside the expert pool and the conversation cache, what the process's RSS holds."""
        if nbytes:
            self.say(f"state checkpoints (to go back to an earlier prefix of a live sequence): "
                     f"{fmt_size(nbytes)} of pinned host RAM for {sessions} session{'s' * (sessions > 1)}")

    def tracing(self, path: Path) -> None:
        self.say(f"recording every token's routing to {path}")

    def learning(self, path: Path, tokens_seen: float | None, writable: bool) -> None:
        """``tokens_seen`` None: no profile yet."""
        self.say(f"learning the placement into {path} "
                 + ("(no profile yet: uniform placement)" if tokens_seen is None else
                    f"({tokens_seen:.0f} tokens learned so far)"))
        if not writable:
            self.warn(f"cannot write in {path.parent}: what is learned is lost at exit "
                      "(--profile PATH learns into a file elsewhere)")

    def moved_to_profile(self, experts: int) -> None:
        self.say(f"moved {experts} experts to where the profile says")

    def parallel(self, n: int, ctx: int, kv: int, state: int, graphs: int, on_gpu: bool) -> None:
        """What ``--parallel`` sequences at ``--ctx`` take (``formats.memory.sequence_bytes``: what
        the ``--vram`` plan holds for them)."""
        line = f"up to {n} requests decoded together (--parallel); their KV caches at --ctx {ctx} take {fmt_size(kv)}"
        if state:
            line += f", their recurrent states {fmt_size(state)}"
        if graphs:
            line += f", their captured prefill calls {fmt_size(graphs)}"
        self.say(line + (" on the GPU" if on_gpu else " in host memory"))

    def conversation_cache(self, ram: int, reserved: int, folder: Path | None, on_disk: int,
                           ram_given: bool) -> None:
        """``ram`` and ``folder`` 0 and None: the cache is off."""
        if ram == 0 and folder is None:
            self.say("conversation cache off: only the live conversation is resumed")
            return
        where = [f"{ram / 2**30:.2f} GiB of host RAM ({reserved / 2**30:.2f} GiB taken now)"] if ram else []
        if folder is not None:
            where.append(f"{folder} ({on_disk} conversation states there)")
        self.say("conversation cache: " + " and ".join(where) + ("" if ram_given else " (--cache-ram sets it)"))

    def bootstrap_hint(self, hint: str) -> None:
        self.say(hint)

    def bootstrap_nothing(self, source: str, auto: bool) -> None:
        self.say(f"bootstrap: nothing to replay from {source}"
                 + (" (no coding agent sessions newer than the profile)" if auto else ""))

    def bootstrap_replaying(self, conversations: int, tokens: int, background: bool) -> None:
        self.say(f"bootstrap: replaying {conversations} conversations ({tokens} tokens)"
                 + (" while idle" if background else " before serving"))

    def summary(self, line: str) -> None:
        """A part's own summary line (a bootstrap's, the learner's at exit)."""
        self.say(line)

    def trace_sealed(self, path: Path, tokens: int) -> None:
        self.say(f"trace {path} ({tokens} tokens)")
