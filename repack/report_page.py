"""The HTML page of ``repack report``: one self-contained file (figures are PNGs embedded as data
URIs, no scripts, no network), readable offline and attachable to an issue.

matplotlib draws through its object interface (``Figure`` + Agg), never pyplot: no GUI backend,
no global state, so it works headless and from threads.
"""
from __future__ import annotations

import base64
import io

import jinja2
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from sparkpack.formats.profile import SIDES

from .report_data import FRACTIONS, TOP_FRACTION, Report

DPI = 110
SIDE_STYLE = {"generated": dict(color="#d62728", label="generated side (decode)"),
              "prompt": dict(color="#1f77b4", label="prompt side")}


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def heatmap(r: Report) -> Figure:
    """Layers x experts, each layer's experts sorted by use; the hot set outlined."""
    use = r.scores[r.moe_layers]
    order = np.argsort(-use, axis=1, kind="stable")
    rows = np.take_along_axis(use, order, axis=1)
    total = rows.sum(axis=1, keepdims=True)
    share = np.divide(rows, total, out=np.zeros_like(rows), where=total > 0)
    n_moe, n_expert = share.shape
    fig = Figure(figsize=(10, 1.6 + 0.16 * n_moe))
    ax = fig.add_subplot()
    positive = share[share > 0]
    norm = LogNorm(vmin=max(positive.min(), 1e-5), vmax=positive.max()) if positive.size else None
    im = ax.imshow(np.where(share > 0, share, np.nan), aspect="auto", cmap="magma", norm=norm,
                   interpolation="nearest")
    if r.hot is not None:
        hot = np.take_along_axis(r.hot[r.moe_layers], order, axis=1)
        ax.add_collection(LineCollection(outline(hot), colors="#00e5ff", linewidths=1.6))
        ax.set_title(f"Expert use per layer, most used first; outlined in cyan: the hot set ({r.hot_source})",
                     fontsize=10)
    else:
        ax.set_title("Expert use per layer, most used first (no hot set given)", fontsize=10)
    ax.set_xlabel(f"experts of the layer, sorted by use ({n_expert} per layer)")
    ax.set_ylabel("MoE layer")
    step = max(1, n_moe // 20)
    ax.set_yticks(range(0, n_moe, step), [str(il) for il in r.moe_layers[::step]])
    fig.colorbar(im, ax=ax, label="share of the layer's use", pad=0.01)
    return fig


def outline(mask: np.ndarray) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Segments (image coordinates) around the True cells of ``mask`` where a neighbour is False."""
    padded = np.pad(mask, 1)
    segs = []
    for i, j in zip(*np.nonzero(mask)):
        pi, pj = i + 1, j + 1
        if not padded[pi, pj - 1]:
            segs.append(((j - 0.5, i - 0.5), (j - 0.5, i + 0.5)))
        if not padded[pi, pj + 1]:
            segs.append(((j + 0.5, i - 0.5), (j + 0.5, i + 0.5)))
        if not padded[pi - 1, pj]:
            segs.append(((j - 0.5, i - 0.5), (j + 0.5, i - 0.5)))
        if not padded[pi + 1, pj]:
            segs.append(((j - 0.5, i + 0.5), (j + 0.5, i + 0.5)))
    return segs


def coverage(r: Report) -> Figure:
    """Expected hit rate against the share of expert bytes kept on the GPU."""
    fig = Figure(figsize=(7.5, 5))
    ax = fig.add_subplot()
    for j, row in enumerate(r.layer_coverage(r.scores)):
        ax.plot(FRACTIONS, row, color="0.6", lw=0.6, alpha=0.6, label="one layer (its own experts)" if j == 0 else None)
    for side, curve in r.overall_coverage().items():
        ax.plot(FRACTIONS, curve, lw=2.2, **SIDE_STYLE[side])
    ax.plot([0, 1], [0, 1], color="k", lw=0.8, ls=":", label="uniform placement")
    frac = r.hot_fraction()
    for side, rate in r.hot_hit_rate().items():
        ax.plot([frac], [rate], "o", ms=8, mfc="none", mew=2, color=SIDE_STYLE[side]["color"])
    if frac is not None:
        ax.axvline(frac, color="#00a0b0", lw=1, ls="--", label=f"hot set ({frac:.0%} of expert bytes)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("share of expert bytes on the GPU" + ("" if r.bytes_known else " (experts counted equal)"))
    ax.set_ylabel("expected hit rate (share of routings served)")
    ax.set_title("Coverage: what each VRAM share buys, experts placed by the profile", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def skew(r: Report) -> Figure:
    """How concentrated each side's routing is per layer, and whether the sides agree."""
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    x = np.arange(len(r.moe_layers))
    rates = {side: r.rates(side) for side in SIDES}
    present = [side for side in SIDES if rates[side] is not None]
    width = 0.8 / max(len(present), 1)
    for i, side in enumerate(present):
        left.bar(x + (i - (len(present) - 1) / 2) * width, r.top_share(rates[side]), width, **SIDE_STYLE[side])
    left.axhline(TOP_FRACTION, color="k", lw=0.8, ls=":", label="uniform routing")
    left.set_ylim(0, 1.2)
    step = max(1, len(x) // 20)
    left.set_xticks(x[::step], [str(il) for il in r.moe_layers[::step]])
    left.set_xlabel("MoE layer")
    left.set_ylabel(f"share of routings taken by the top {TOP_FRACTION:.0%} of experts")
    left.set_title("Skew per layer and side", fontsize=10)
    left.legend(fontsize=8, loc="upper center", ncol=3)
    gen, prompt = rates["generated"], rates["prompt"]
    if gen is None or prompt is None:
        missing = "generated" if gen is None else "prompt"
        right.text(0.5, 0.5, f"no {missing}-side tokens learned yet:\nnothing to compare", ha="center", va="center",
                   fontsize=11, transform=right.transAxes)
        right.set_axis_off()
    else:
        a, b = prompt[r.moe_layers].ravel(), gen[r.moe_layers].ravel()
        floor = min(v[v > 0].min() for v in (a, b) if (v > 0).any()) / 2 if ((a > 0) | (b > 0)).any() else 1e-6
        right.scatter(np.maximum(a, floor), np.maximum(b, floor), s=6, alpha=0.4, color="#6a3d9a")
        hi = max(a.max(), b.max(), floor * 10)
        right.plot([floor, hi], [floor, hi], color="k", lw=0.8, ls=":")
        right.set_xscale("log")
        right.set_yscale("log")
        right.set_xlabel("prompt-side routings per token")
        right.set_ylabel("generated-side routings per token")
        right.set_title("Each expert: prompt vs generated use", fontsize=10)
    return fig


def timeline(r: Report) -> Figure:
    t = r.timeline
    fig = Figure(figsize=(10, 3.8))
    ax = fig.add_subplot()
    starts = np.array(t.start)
    ax.fill_between(starts, 0, t.generated_share, step="post", color=SIDE_STYLE["generated"]["color"], alpha=0.12,
                    label="generated-side share of the window's tokens")
    ax.step(starts, t.hit_rate, where="post", color="#00a0b0", lw=1.8, label="hit rate of the hot set")
    ax.axhline(t.overall, color="#00a0b0", lw=0.8, ls="--", label=f"over the whole trace: {t.overall:.1%}")
    expected = r.hot_hit_rate().get("prompt")
    if expected is not None:
        ax.axhline(expected, color="k", lw=0.8, ls=":", label=f"expected from the profile (prompt side): {expected:.1%}")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0, starts[-1] + t.window if len(starts) else 1)
    ax.set_xlabel(f"token of the trace (windows of {t.window})")
    ax.set_ylabel("share of routings served by hot experts")
    ax.set_title("Hit rate over time", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    return fig


PAGE = jinja2.Environment(autoescape=True).from_string("""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ d.title }}: routing report</title>
<style>
 body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1180px; padding: 0 1em; color: #222 }
 h1 { font-size: 1.5em } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd }
 table { border-collapse: collapse } td, th { padding: 2px 10px; text-align: right }
 th { background: #f2f2f2 } td:first-child, th:first-child { text-align: left }
 table.facts td { text-align: left } table.facts td:first-child { color: #555 }
 img { max-width: 100%; height: auto; display: block; margin: .6em 0 }
 .note { color: #555; font-size: 12.5px }
</style></head><body>
<h1>{{ d.title }}</h1>
<table class="facts">
 <tr><td>architecture</td><td>{{ d.arch }}, {{ d.moe_layers|length }} MoE layers x {{ d.n_expert }} experts</td></tr>
 <tr><td>model identity</td><td>{{ d.identity.file_size }} bytes, header {{ d.identity.header_hash[7:19] }}</td></tr>
 <tr><td>tokens in the profile</td><td>{{ "%.0f"|format(d.tokens.prompt) }} prompt-side, {{ "%.0f"|format(d.tokens.generated) }} generated-side</td></tr>
 {% if d.decay %}<tr><td>learned live</td><td>from {{ "%.0f"|format(d.decay.tokens_seen) }} tokens, half-life {{ "%.0f"|format(d.decay.half_life_tokens) }} tokens</td></tr>{% endif %}
 {% if d.hot_set %}<tr><td>hot set</td><td>{{ d.hot_set.experts }} of {{ d.hot_set.of }} experts ({{ "%.1f"|format(100 * d.hot_set.byte_fraction) }}% of expert bytes), {{ d.hot_set.source }}</td></tr>
 {% for side, rate in d.hot_set.expected_hit_rate.items() %}<tr><td>expected hit rate, {{ side }} side</td><td>{{ "%.1f"|format(100 * rate) }}%</td></tr>{% endfor %}{% endif %}
</table>
<h2>Routing heatmap</h2>
<img alt="heatmap of expert use per layer" src="data:image/png;base64,{{ figs.heatmap }}">
<p class="note">Use = expected hits per token, {{ "decode-weighted" }} as the planner ranks experts. Each row is one MoE layer with its experts sorted by use (white: never routed); a flat row means that layer needs many hot experts, a steep one few.</p>
<h2>Coverage</h2>
<img alt="coverage curve" src="data:image/png;base64,{{ figs.coverage }}">
<p class="note">Experts taken in the planner's order (hits per byte across layers). The dotted diagonal is what a uniform placement gets.{% if d.hot_set %} Circles: the hot set above.{% endif %}</p>
<h2>Prompt vs generated</h2>
<img alt="skew per layer and side" src="data:image/png;base64,{{ figs.skew }}">
{% if figs.timeline %}<h2>Hit rate over time</h2>
<img alt="hit rate over the trace" src="data:image/png;base64,{{ figs.timeline }}">
<p class="note">{{ trace_note }}</p>{% endif %}
<h2>Per layer</h2>
<table><tr><th>layer</th><th>top {{ "%.0f"|format(100 * d.top_share.fraction) }}% share</th>{% if d.hot_set %}<th>hot experts</th>{% endif %}</tr>
{% for il in d.moe_layers %}<tr><td>{{ il }}</td><td>{{ "%.1f"|format(100 * d.top_share.use[loop.index0]) }}%</td>{% if d.hot_set %}<td>{{ d.hot_set.per_layer[il|string] }}</td>{% endif %}</tr>
{% endfor %}</table>
<p class="note">Made by <code>repack report</code>.</p>
</body></html>
""")


def render(r: Report, trace_note: str = "") -> tuple[str, dict[str, bytes]]:
    """The page and the PNG bytes of each figure in it (tests decode them back from the page)."""
    figs = {"heatmap": png(heatmap(r)), "coverage": png(coverage(r)), "skew": png(skew(r))}
    if r.timeline is not None:
        figs["timeline"] = png(timeline(r))
    encoded = {k: base64.b64encode(v).decode() for k, v in figs.items()}
    return PAGE.render(d=r.to_json(), figs=encoded, trace_note=trace_note), figs
