"""What a run says about itself on stderr: where its experts sit once loaded, and its numbers
at the end (``--stats-json`` writes them too). The CLI, the server and calibration wire a run;
the lines it prints are written here.
"""
from __future__ import annotations

from pathlib import Path

import click

from sparkpack.formats.atomic_file import write_atomic


def report_residency(model) -> None:
    r, st = model.residency, model.store
    d = st.describe()
    line = f"experts: {d['hot_experts']}/{d['experts']} hot ({d['hot_fraction']:.0%}, {r.source})"
    if d["host_tier"] == "none":  # nothing is cold: no misses, no host tier
        line += ", none cold"
    else:
        line += f", {d['cache_slots']} cache slots, misses via {d['mode']}, cold experts in {d['host_tier']} memory"
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
