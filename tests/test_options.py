"""spark-run's flags become one RunOptions; the store's options, the sessions and the server's
sampling defaults are read from it."""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from sparkpack.formats.errors import SparkpackError
from sparkpack.runtime.cli import run_cmd
from sparkpack.runtime.learn_flags import FLAG_NAMES, learning_flags
from sparkpack.runtime.learning import LearnOptions
from sparkpack.runtime.options import RunOptions, SamplingOptions, compute_dtype, run_options, store_options
from sparkpack.runtime.residency import StoreOptions


def parsed(*args: str) -> RunOptions:
    """``spark-run MODEL ARGS`` parsed by click and built as run_cmd builds it."""
    ctx = run_cmd.make_context("spark-run", ["m.gguf", *args])
    own = set(inspect.signature(run_cmd.callback).parameters) - {"model_path", "options"}
    flags = {k: v for k, v in ctx.params.items() if k not in own and k != "model_path"}
    flags["learning"] = learning_flags(**{name: flags.pop(name) for name in FLAG_NAMES})  # as learning_options does
    return run_options(ctx.params["model_path"], **flags)


def test_every_flag_has_a_field():
    """No flag is dropped or renamed on the way: each reaches RunOptions (or its SamplingOptions)."""
    opts = parsed("--device", "cpu", "--vram", "1GiB", "--hot-fraction", "0.5", "--cache-slots", "3",
                  "--profile", "p.json", "--stream", "zerocopy", "--host-ram", "2GiB", "--ctx", "512",
                  "--kv-type", "q8_0", "--prefill-chunk", "64", "--threads", "2", "--dtype", "float64",
                  "--expert-cache", "1MiB", "--max-tokens", "7", "--temperature", "0.5", "--top-k", "3",
                  "--top-p", "0.5", "--min-p", "0.1", "--repeat-penalty", "1.1", "--seed", "9",
                  "--stats-json", "s.json", "--half-life", "5000", "--generated-weight", "0.25",
                  "--profile-save-every", "3", "--force", "--trace-out", "t.trace")
    assert opts == RunOptions(Path("m.gguf"), device="cpu", dtype="float64", threads=2, expert_cache=2**20,
                              vram=2**30, hot_fraction=0.5, cache_slots=3, profile=Path("p.json"),
                              stream_mode="zerocopy", host_ram=2 * 2**30, ctx=512, kv_type="q8_0", prefill_chunk=64,
                              max_tokens=7, stats_json=Path("s.json"),
                              sampling=SamplingOptions(temperature=0.5, top_k=3, top_p=0.5, min_p=0.1,
                                                       repetition_penalty=1.1, seed=9),
                              learning=learning_flags(half_life=5000, generated_weight=0.25, profile_save_every=3,
                                                      force=True, trace_out=Path("t.trace")))
    assert opts.learning.learn is not None and opts.learning.learn.half_life_tokens == 5000
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.ctx = 1  # type: ignore[misc]


def test_store_options_follow_the_flags():
    opts = parsed("--device", "cpu", "--hot-fraction", "0.5", "--ctx", "512", "--kv-type", "q8_0",
                  "--prefill-chunk", "64", "--host-ram", "1GiB")
    assert store_options(opts) == StoreOptions(hot_fraction=0.5, host_bytes=2**30, ctx=512, kv_type="q8_0",
                                               prefill_chunk=64, learn=LearnOptions())  # learning on by default
    assert store_options(parsed("--device", "cpu")) is None  # the plain path on the CPU
    forced = store_options(parsed("--device", "cpu", "--store"))
    assert forced is not None and forced.host_bytes is not None  # 80% of the available memory by default
    assert store_options(parsed("--device", "cpu", "--stream", "async")).mode == "async"
    with pytest.raises(SparkpackError, match="--no-store cannot be combined"):
        parsed("--device", "cpu", "--no-store", "--vram", "1GiB")


def test_defaults_are_the_flags_defaults():
    """What calibrate (or a test) builds without flags is what spark-run runs without them."""
    assert parsed("--device", "cpu") == run_options(Path("m.gguf"), device="cpu")
    import torch

    assert compute_dtype(run_options(Path("m.gguf"), device="cpu")) == torch.float32
    assert compute_dtype(RunOptions(Path("m.gguf"), device="cuda")) == torch.bfloat16


def test_request_fields_are_the_sampling_options():
    """A request's sampling fields override the server's defaults field by field, by name."""
    from sparkpack.runtime.server.schemas import Sampling

    assert set(Sampling.model_fields) == {f.name for f in dataclasses.fields(SamplingOptions)}
