"""spark-run's flags become one tree of settings (RunOptions) that each layer reads; the store's
options, the sessions' and the server's are its branches, built once."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparkpack.formats.errors import SparkpackError
from sparkpack.runtime.cli import run_cmd
from sparkpack.runtime.options import (LearningFlags, LearnOptions, RunOptions, SamplingOptions, ServeOptions,
                                       SessionOptions, StoreOptions, compute_dtype, run_options)

PROMPT_FLAGS = {"prompt", "prompt_file", "system", "raw", "prompt_ids", "prompt_ids_file", "logits_out"}


def parsed(*args: str) -> RunOptions:
    """``spark-run MODEL ARGS`` parsed by click and translated as run_cmd translates it."""
    ctx = run_cmd.make_context("spark-run", ["m.gguf", *args])
    flags = {k: v for k, v in ctx.params.items() if k not in PROMPT_FLAGS and k != "model_path"}
    return run_options(ctx.params["model_path"], **flags)


def test_every_flag_has_a_field():
    """No flag is dropped or renamed on the way: each reaches its branch of the tree."""
    opts = parsed("--device", "cpu", "--vram", "1GiB", "--hot-fraction", "0.5", "--cache-slots", "3",
                  "--profile", "p.json", "--miss-mode", "zerocopy", "--host-ram", "2GiB", "--ctx", "512",
                  "--kv-type", "q8_0", "--prefill-chunk", "64", "--threads", "2", "--dtype", "float64",
                  "--dequant-limit", "1MiB", "--max-tokens", "7", "--temperature", "0.5", "--top-k", "3",
                  "--top-p", "0.5", "--min-p", "0.1", "--repeat-penalty", "1.1", "--seed", "9",
                  "--stats-json", "s.json", "--half-life", "5000", "--generated-weight", "0.25",
                  "--profile-save-every", "3", "--force", "--trace-out", "t.trace", "--serve", "--host", "::1",
                  "--port", "0", "--api-key", "k", "--cache-ram", "1MiB", "--cache-dir", "states", "--parallel", "3",
                  "--step-tokens", "64")
    assert opts == RunOptions(
        model_path=Path("m.gguf"), device="cpu", dtype="float64", threads=2, dequant_limit=2**20,
        store=StoreOptions(vram=2**30, hot_fraction=0.5, cache_slots=3, profile=Path("p.json"), miss_mode="zerocopy",
                           host_ram=2 * 2**30, generated_weight=0.25,
                           learn=LearnOptions(half_life_tokens=5000, save_every_s=3, force=True)),
        session=SessionOptions(ctx=512, kv_type="q8_0", prefill_chunk=64, sequences=3), max_tokens=7, stats_json=Path("s.json"),
        sampling=SamplingOptions(temperature=0.5, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.1, seed=9),
        learning=LearningFlags(trace_out=Path("t.trace")),
        serve=ServeOptions(host="::1", port=0, api_key="k", cache_ram=2**20, cache_dir=Path("states"), parallel=3,
                           step_tokens=64))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.session.ctx = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        SessionOptions(512)  # type: ignore[misc]  # keyword arguments only


def test_the_store_runs_where_spark_run_says():
    opts = parsed("--device", "cpu", "--hot-fraction", "0.5", "--host-ram", "1GiB")
    assert opts.store == StoreOptions(hot_fraction=0.5, host_ram=2**30, learn=LearnOptions())  # learning on by default
    assert parsed("--device", "cpu").store is None  # the plain path on the CPU
    forced = parsed("--device", "cpu", "--store").store
    assert forced is not None and forced.host_ram is not None  # 80% of the available memory by default
    assert parsed("--device", "cpu", "--miss-mode", "async").store.miss_mode == "async"
    assert parsed("--device", "cpu", "--store", "--no-learn").store.learn is None
    assert parsed("--device", "cpu", "--trace-out", "t.trace").store is not None  # only the store sees routings
    assert parsed("--device", "cpu", "--serve").serve == ServeOptions()
    assert parsed("--device", "cpu").serve is None


@pytest.mark.parametrize("args, says", [
    (("--no-store", "--vram", "1GiB"), "--no-store cannot be combined"),
    (("--bootstrap", "auto"), "needs --serve"),
    (("--serve", "--bootstrap", "auto", "--no-learn"), "cannot be combined with --no-learn"),
    (("--serve", "--bootstrap-background"), "needs --bootstrap"),
    (("--cache-ram", "1GiB"), "use them with --serve"),
    (("--serve", "--api-key", "k", "--api-key-file", __file__), "either --api-key or --api-key-file"),
])
def test_combinations_that_cannot_work_are_one_line(args, says):
    with pytest.raises(SparkpackError, match=says):
        parsed("--device", "cpu", *args)


def test_defaults_are_the_flags_defaults():
    """What calibrate (or a test) builds without flags is what spark-run runs without them."""
    assert parsed("--device", "cpu") == run_options(Path("m.gguf"), device="cpu")
    import torch

    assert compute_dtype(run_options(Path("m.gguf"), device="cpu")) == torch.float32
    assert compute_dtype(RunOptions(model_path=Path("m.gguf"), device="cuda")) == torch.bfloat16


def test_request_fields_are_the_sampling_options():
    """A request's sampling fields override the server's defaults field by field, by name."""
    from sparkpack.runtime.server.schemas import Sampling

    assert set(Sampling.model_fields) == {f.name for f in dataclasses.fields(SamplingOptions)}


def test_calibrate_opens_the_model_as_spark_run_does():
    """repack calibrate's model flags are spark-run's of those names, learning off."""
    from sparkpack.repack.calibrate_cmd import calibrate_options

    opts = calibrate_options(Path("m.gguf"), corpus=Path("logs"), device="cpu", ctx=512, prefill_chunk=64,
                             hot_fraction=0.5, host_ram=2**30)
    assert opts.router.run_options(opts.model_path) == parsed(
        "--device", "cpu", "--ctx", "512", "--prefill-chunk", "64", "--hot-fraction", "0.5", "--host-ram", "1GiB",
        "--no-learn")
    with pytest.raises(SparkpackError, match="either --corpus"):
        calibrate_options(Path("m.gguf"), corpus=Path("logs"), eval_path=Path("held.trace"))
