"""The README's "Your first hour" commands, run in order as a user would, and what they must do:
the calibration is used by split and spark-run without being named, and a profile of another
model is reported in one line instead of being dropped silently."""
from __future__ import annotations

import json
import os
import re
import shlex

import numpy as np
import pytest

from tests.procs import REPACK, REPO, SPARK_RUN, run

PROGRAMS = {"repack": REPACK, "spark-run": SPARK_RUN}


def readme_commands() -> list[list[str]]:
    """The ``$ `` lines of the README's walkthrough section, in order."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Your first hour", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line[2:], comments=True) for line in section.splitlines() if line.startswith("$ ")]


@pytest.mark.slow
def test_readme_walkthrough_places_experts_by_the_calibration(tmp_path):
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.memory import MemoryTarget
    from sparkpack.formats.placement import Budget, plan_residency
    from sparkpack.formats.profile import Profile
    from sparkpack.formats.sparkpack import Pack

    os.symlink(REPO / "corpora", tmp_path / "corpora")
    commands = readme_commands()
    assert [c[:2] for c in commands] == [["repack", "synth"], ["repack", "calibrate"], ["repack", "inspect"],
                                         ["repack", "split"], ["spark-run", "model.sparkpack"],
                                         ["spark-run", "model.sparkpack"]]
    shown = {}
    for argv in commands:
        chat = argv[0] == "spark-run" and "-p" not in argv
        res = run([*PROGRAMS[argv[0]], *argv[1:]], cwd=tmp_path, input="hello\n/exit\n" if chat else None)
        assert res.returncode == 0, (argv, res.stderr)
        shown[" ".join(argv[:2]) + (" chat" if chat else "")] = res
        if argv[:2] == ["repack", "split"]:  # the profile split placed with (spark-run learns on into it)
            prof = Profile.load(tmp_path / "model.profile.json")

    split = shown["repack split"].stderr
    assert "placement from profile model.profile.json (found beside the model)" in split
    # the pack's hot set is the one the profile gives under split's budget, not the uniform one
    gguf = GGUFModel(tmp_path / "model.gguf")
    spec = model_spec(gguf)
    budget, target = Budget(hot_fraction=0.5), MemoryTarget.gpu(spec, 4096)  # split's default
    want = plan_residency(spec, gguf.tensors, budget, target, profile=prof)
    uniform = plan_residency(spec, gguf.tensors, budget, target)
    pack = Pack.open(tmp_path / "model.sparkpack")
    assert np.array_equal(pack.hot, want.hot) and not np.array_equal(pack.hot, uniform.hot)
    assert pack.manifest.placement.profile == "model.profile.json"
    # spark-run finds the profile beside the pack too: it reports the expected cold-hit rate
    run_line = shown["spark-run model.sparkpack"].stderr
    assert "the pack's placement" in run_line and "expected cold-hit rate" in run_line
    learned = Profile.load(tmp_path / "model.profile.json")  # the runs learned on from the calibration
    assert learned.decay is not None and learned.decay.tokens_seen > sum(prof.tokens.values())
    # one reply, then /exit (never sent to the model): the run's prompt tokens are those of the one
    # "hello" turn (a second turn would add its own). The chat samples, and a sampled reply may hold
    # any character, line breaks included, so its stdout's lines say nothing
    from sparkpack.runtime.chat_template import ChatTemplate
    from sparkpack.runtime.tokenizer import GGUFTokenizer

    chat = shown["spark-run model.sparkpack chat"]
    tok = GGUFTokenizer.from_metadata(gguf)
    turn = ChatTemplate.from_tokenizer(gguf.get("tokenizer.chat_template"), tok).render(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True)
    prefilled = re.findall(r"\[prefill (\d+) tok", chat.stderr)
    assert chat.stdout.strip() and prefilled == [str(len(tok.encode(turn, add_special=False)))], chat.stderr
    assert "skew" in shown["repack inspect"].stdout and "this model" in shown["repack inspect"].stdout
    # calibrate's progress bar ended at its total
    assert re.search(r"replay: 100%", shown["repack calibrate"].stderr)


@pytest.mark.slow
def test_a_profile_of_another_model_is_named_not_dropped(synth_model, tmp_path):
    """MODEL.profile.json beside MODEL but recorded on another model: split, export and a
    spark-run that does not learn say so in one line and place experts without it; a spark-run
    that learns (the default) would write there, so it refuses in one line and leaves it be."""
    model = tmp_path / "model.gguf"
    os.link(synth_model("qwen3moe"), model)  # a private name: the profile beside it is this test's
    other = synth_model("qwen3moe", seed=1)
    from click.testing import CliRunner

    from sparkpack.repack.calibrate_cmd import calibrate_cmd

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    res = CliRunner().invoke(calibrate_cmd, [str(other), "--corpus", str(corpus), "-o",
                                             str(tmp_path / "model.profile.json"), "--quiet"])
    assert res.exit_code == 0, res.output

    split = run([*REPACK, "split", str(model), "--hot-fraction", "0.5"])
    assert split.returncode == 0, split.stderr
    warnings = [ln for ln in split.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "model.profile.json" in warnings[0] and "another model" in warnings[0]
    assert "no profile: placing experts uniformly" in split.stderr

    before = (tmp_path / "model.profile.json").read_bytes()
    spark_args = [*SPARK_RUN, str(model), "--hot-fraction", "0.5", "-p", "hi", "--max-tokens", "2", "--threads", "1",
                  "--device", "cpu"]
    spark = run(spark_args)
    assert spark.returncode == 1 and len(spark.stderr.strip().splitlines()) == 1, spark.stderr
    assert "another model" in spark.stderr and "--force" in spark.stderr
    assert (tmp_path / "model.profile.json").read_bytes() == before
    spark = run([*spark_args, "--no-learn"])
    assert spark.returncode == 0, spark.stderr
    warnings = [ln for ln in spark.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "another model" in warnings[0], spark.stderr
    assert "uniform placement (no profile)" in spark.stderr

    export = run([*REPACK, "export", str(model), "--llama-cpp", "--vram", "2GiB"])
    assert export.returncode == 0, export.stderr
    warnings = [ln for ln in export.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "another model" in warnings[0], export.stderr
