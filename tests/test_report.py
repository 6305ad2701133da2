"""repack report: the page holds its figures (decoded back from the HTML), the numbers agree with
the planner and the trace evaluation, packs and bare profiles work, bad input gets one line, and
(where chromium is installed) the page renders headless to a screenshot that shows the figures."""
from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from sparkpack.calibrate.evaluate import cold_rate
from sparkpack.calibrate.trace import read_trace
from sparkpack.formats.placement import cold_hit_rates
from sparkpack.formats.profile import Profile
from sparkpack.formats.sparkpack import Pack
from sparkpack.repack.cli import cli
from tests.commands import calibrate_in_process

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("heatmap of expert use per layer", "coverage curve", "skew per layer and side", "hit rate over the trace")


@pytest.fixture(scope="module")
def learned(synth_model, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model with a profile beside it (calibrated on the bundled corpus, which has
    generated-side turns) and a trace of other traffic."""
    root = tmp_path_factory.mktemp("report")
    model = root / "tiny.gguf"
    model.write_bytes(synth_model("qwen35moe", skew="reference").read_bytes())
    calibrate_in_process(model, "--corpus", REPO / "corpora", "--max-tokens", "3000")  # README.md, then chats
    held = root / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [
        "Write a Python function that parses ISO dates and explain the edge cases.",
        "Why does my Rust borrow checker complain about a mutable reference in a loop?",
    ]))
    calibrate_in_process(model, "--corpus", held, "-o", root / "held.profile.json", "--trace", root / "held.trace")
    return model, root / "held.trace"


def run(*args: object) -> str:
    res = CliRunner().invoke(cli, ["report", *map(str, args)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def pngs(html: str) -> dict[str, Image.Image]:
    found = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">', html)
    return {alt: Image.open(io.BytesIO(base64.b64decode(data))) for alt, data in found}


@pytest.mark.slow
def test_page_holds_every_figure(learned, tmp_path):
    model, trace = learned
    out = tmp_path / "r.html"
    assert "wrote" in run(model, "--hot-fraction", "0.5", "--trace", trace, "-o", out)
    html = out.read_text()
    figs = pngs(html)
    assert sorted(figs) == sorted(FIGURES)
    for alt, im in figs.items():
        assert im.format == "PNG" and im.width >= 600 and im.height >= 250, (alt, im.size)
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 50, alt  # drawn, not blank
    assert "<script" not in html and "http://" not in html and "https://" not in html  # self-contained
    assert "tiny.gguf" in html and "generated-side" in html


@pytest.mark.slow
def test_numbers_agree_with_the_planner_and_the_trace(learned):
    model, trace = learned
    d = json.loads(run(model, "--hot-fraction", "0.5", "--trace", trace, "--json"))
    prof = Profile.load(model.with_name("tiny.profile.json"))
    hot = np.zeros((prof.n_layer, prof.n_expert), bool)
    for il, n in d["hot_set"]["per_layer"].items():
        assert 0 < n < prof.n_expert
    # the page's hot set is the planner's: recompute its expected rates from the same profile
    from sparkpack.formats.placement import make_plan

    nbytes = {int(il): nb for il, nb in d["expert_bytes"].items()}
    plan = make_plan(prof.n_layer, prof.n_expert, nbytes, int(0.5 * sum(nbytes.values()) * prof.n_expert + 0.5),
                     prof.counts, prof.tokens)
    hot = plan.hot
    for side, rate in cold_hit_rates(hot, prof.counts).items():
        assert d["hot_set"]["expected_hit_rate"][side] == pytest.approx(1 - rate)
    tr = read_trace(trace)
    assert d["timeline"]["overall"] == pytest.approx(1 - cold_rate(np.asarray(tr.ids), hot[tr.moe_layers]))
    cov = d["coverage"]
    for curve in [*cov["overall"].values(), *cov["per_layer"].values()]:
        assert curve[0] == 0 and curve[-1] == pytest.approx(1) and np.all(np.diff(curve) >= -1e-12)
    assert set(cov["overall"]) == {"prompt", "generated"}
    assert len(d["top_share"]["use"]) == len(d["moe_layers"]) and all(0.6 <= s <= 1 for s in d["top_share"]["use"])


def test_pack_and_bare_profile(learned, tmp_path):
    model, _ = learned
    pack = tmp_path / "tiny.sparkpack"
    CliRunner().invoke(cli, ["split", str(model), "--profile", str(model.with_name("tiny.profile.json")),
                             "--hot-fraction", "0.4", "-o", str(pack)], catch_exceptions=False)
    shutil.copy(model.with_name("tiny.profile.json"), tmp_path / "tiny.profile.json")
    d = json.loads(run(pack, "--json"))
    assert d["hot_set"]["experts"] == int(Pack.open(pack).hot.sum()) and "pack" in d["hot_set"]["source"]
    run(pack, "-o", tmp_path / "pack.html")
    assert sorted(pngs((tmp_path / "pack.html").read_text())) == sorted(FIGURES[:3])
    d = json.loads(run(tmp_path / "tiny.profile.json", "--hot-fraction", "0.25", "--json"))
    assert d["expert_bytes"] is None and d["hot_set"]["byte_fraction"] == pytest.approx(0.25)


def test_existing_page_needs_force(learned, tmp_path):
    """The one output rule of every repack command: an existing page is refused (and kept) unless
    --force replaces it."""
    model, _ = learned
    page = tmp_path / "r.html"
    page.write_text("mine")
    assert "already exists (use --force to replace it)" in one_error_line(model, "--hot-fraction", "0.5", "-o", page)
    assert page.read_text() == "mine"
    assert "wrote" in run(model, "--hot-fraction", "0.5", "-o", page, "--force")
    assert sorted(pngs(page.read_text())) == sorted(FIGURES[:3])


def one_error_line(*args: object) -> str:
    res = subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "report", *map(str, args)],
                         capture_output=True, text=True, cwd=REPO)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_bad_input_gets_one_line(learned, synth_model, tmp_path):
    model, trace = learned
    assert "no such profile" in one_error_line(synth_model("qwen3moe"))
    assert "needs a hot set" in one_error_line(model, "--trace", trace)
    assert "--vram needs the model" in one_error_line(model.with_name("tiny.profile.json"), "--vram", "1GiB")
    other = tmp_path / "other.gguf"
    other.write_bytes(synth_model("qwen35moe", skew="reference", seed=3).read_bytes())
    shutil.copy(model.with_name("tiny.profile.json"), tmp_path / "other.profile.json")
    assert "profile is for another model" in one_error_line(other)
    assert "no such model, pack or profile" in one_error_line(tmp_path / "nope.gguf")


def test_headless_screenshot_shows_the_figures(learned, tmp_path):
    """What a person sees: chromium renders the page (no network, no GPU) to a PNG with the
    figures drawn. .ci/run does not install chromium (the package alone took ~1 minute here),
    so this test runs where it is installed."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); the page's figures are still "
                    "checked by test_page_holds_every_figure")
    model, trace = learned
    page, shot = tmp_path / "r.html", tmp_path / "shot.png"
    run(model, "--hot-fraction", "0.5", "--trace", trace, "-o", page)
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--no-first-run", "--hide-scrollbars", "--window-size=1280,4000",
                    f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
    im = Image.open(shot).convert("RGB")
    assert im.size == (1280, 4000)
    pixels = np.asarray(im).astype(int)
    colored = (pixels.max(axis=2) - pixels.min(axis=2)) > 60  # figure ink; the page's text is grey
    rows = np.flatnonzero(colored.any(axis=1))
    bands = np.split(rows, np.flatnonzero(np.diff(rows) > 40) + 1) if len(rows) else []
    assert colored.mean() > 0.01 and len(bands) >= 4, (colored.mean(), len(bands))  # each figure drawn
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 500  # heatmap colours, not a blank page
