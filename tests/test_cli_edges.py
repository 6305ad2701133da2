"""The small edges a newcomer meets first, each through the real commands: help, typos,
versions, option ranges, what --compress did, what a profile holds, --ctx and --threads."""
from __future__ import annotations

import json
import os
from importlib.metadata import version

import pytest

from tests.procs import REPACK, SPARK_RUN, error_lines, run


def test_bare_repack_prints_help_and_succeeds():
    res = run(REPACK)
    assert res.returncode == 0 and res.stderr == ""
    assert "Commands:" in res.stdout and "calibrate" in res.stdout


def test_a_mistyped_command_gets_a_suggestion():
    res = run([*REPACK, "splt", "model.gguf"])
    assert res.returncode == 2 and error_lines(res.stderr) == [
        "repack: error: no such command 'splt'; did you mean 'split'? (see 'repack --help')"]


@pytest.mark.parametrize("argv", [REPACK, SPARK_RUN])
def test_version(argv):
    res = run([*argv, "--version"])
    assert res.returncode == 0 and version("sparkpack") in res.stdout


def test_inspect_rejects_a_negative_context(synth_model):
    res = run([*REPACK, "inspect", str(synth_model("qwen3moe")), "--ctx", "-5"])
    lines = error_lines(res.stderr)
    assert res.returncode == 2 and len(lines) == 1 and "--ctx" in lines[0] and "-5" in lines[0]
    assert "KV" not in res.stdout


@pytest.mark.parametrize("quant, said", [("Q8_0", "zstd saved nothing"), ("F16", "% of")])
def test_compress_says_what_it_did(synth_model, tmp_path, quant, said):
    """Random Q8_0 blocks do not shrink (zstd stores them as they are); F16 weights do, a little."""
    pack = tmp_path / "m.sparkpack"
    res = run([*REPACK, "split", str(synth_model("qwen3moe", quant=quant)), "--compress", "--hot-fraction", "0",
               "-o", str(pack)])
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("zstd"))
    assert said in line
    inspect = run([*REPACK, "inspect", str(pack)]).stdout
    assert ("zstd saved nothing" in inspect) == (said == "zstd saved nothing")


@pytest.mark.slow
def test_inspect_describes_a_profile(synth_model, tmp_path):
    from click.testing import CliRunner

    from sparkpack.formats.profile import Profile
    from sparkpack.repack.calibrate_cmd import calibrate_cmd

    model = tmp_path / "m.gguf"
    os.link(synth_model("qwen3moe", skew="reference"), model)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": f"question {i} about topic {i * 3}"}) + "\n" for i in range(12)))
    res = CliRunner().invoke(calibrate_cmd, [str(model), "--corpus", str(corpus), "--quiet"])
    assert res.exit_code == 0, res.output
    shown = run([*REPACK, "inspect", str(tmp_path / "m.profile.json")])
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    prof = Profile.load(tmp_path / "m.profile.json")
    assert f"{prof.tokens['prompt']:.0f} prompt-side" in out and "m.gguf: this model" in out
    assert "top-4" in out and "skew" in out and all(f in out for f in ("20%", "40%", "60%", "80%"))
    report = json.loads(run([*REPACK, "inspect", str(tmp_path / "m.profile.json"), "--json"]).stdout)
    for side in ("prompt", "generated"):
        cover = [report["coverage"][f][side] for f in ("20%", "40%", "60%", "80%")]
        assert cover == sorted(cover) and 0 < cover[0] and cover[-1] <= 1
    # a skewed router: the hot fifth serves more than a fifth of the routings
    assert report["coverage"]["20%"]["prompt"] > 0.2 and report["top60_share"] > 0.6
    os.unlink(model)  # the model beside it is gone: the profile still describes itself
    assert "beside it" not in run([*REPACK, "inspect", str(tmp_path / "m.profile.json")]).stdout


def test_a_prompt_longer_than_ctx_is_refused(synth_model):
    res = run([*SPARK_RUN, str(synth_model("qwen3moe")), "-p", "word " * 80, "--ctx", "64", "--threads", "1", "--device", "cpu"])
    lines = error_lines(res.stderr)
    assert res.returncode == 1 and len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0].startswith("spark-run: error: the prompt is ") and "--ctx is 64" in lines[0]
    assert res.stdout == ""


@pytest.mark.slow
def test_generation_stops_at_the_end_of_the_context(synth_model, tmp_path):
    """On the CPU: no decode step is spent capturing a CUDA graph, so the counts are exact."""
    ids = ",".join(str(i) for i in range(100, 120))  # 20 prompt tokens, room for 4 in --ctx 24
    stats = tmp_path / "s.json"
    res = run([*SPARK_RUN, str(synth_model("qwen3moe")), "--prompt-ids", ids, "--ctx", "24", "--max-tokens", "50",
               "--temperature", "0", "--threads", "1", "--device", "cpu", "--stats-json", str(stats)])
    assert res.returncode == 0, res.stderr
    assert "[stopped: the context is full (--ctx 24)]" in res.stderr
    s = json.loads(stats.read_text())
    # 20 prompt tokens and 4 generated; the last one is read from the logits, never fed
    assert s["prefill_tokens"] == 20 and s["decode_tokens"] == 3


@pytest.mark.slow
def test_threads_and_the_plan_line_of_an_all_hot_store(synth_model, tmp_path):
    stats = tmp_path / "s.json"
    res = run([*SPARK_RUN, str(synth_model("qwen3moe")), "--store", "-p", "hi", "--max-tokens", "2",
               "--threads", "1", "--device", "cpu", "--stats-json", str(stats),
               "--no-learn"])  # (a model the session's tests share: no profile written beside it)
    assert res.returncode == 0, res.stderr
    assert json.loads(stats.read_text())["cpu_threads"] == 1
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("experts:"))
    assert "none cold" in line and "none memory" not in line


def test_convert_hf_refuses_k_quants_it_cannot_write(tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    out = tmp_path / "m.gguf"  # refused before the checkpoint folder is even read
    res = run([*REPACK, "convert-hf", str(tmp_path), "-o", str(out), "--outtype", "Q4_K_M"])
    lines = error_lines(res.stderr)
    assert res.returncode == 1 and len(lines) == 1 and not out.exists()
    assert "q4_k_m" in lines[0] and "available: f32, f16, bf16, q8_0" in lines[0]
    with pytest.raises(NotImplementedError):  # what the message says is what gguf-py does
        quantize(np.zeros((1, 256), np.float32), T.Q4_K)
    assert "no quantizer for Q4_K, Q6_K" in lines[0]
