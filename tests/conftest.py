"""Shared fixtures. Helpers append their own fixtures here; keep each one small."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# On a machine of several GPUs (SPARKPACK_TEST_GPUS=n, set by bench/gpu_session.sh cudatests), each
# pytest-xdist worker takes one GPU, round robin, so the CUDA tests run on all of them at once. It
# must be set before torch first touches CUDA; the servers the tests start inherit it.
_GPUS = int(os.environ.get("SPARKPACK_TEST_GPUS", "1") or "1")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _GPUS > 1 and _WORKER.startswith("gw"):
    _VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if os.environ.get("CUDA_VISIBLE_DEVICES") \
        else [str(i) for i in range(_GPUS)]
    os.environ["CUDA_VISIBLE_DEVICES"] = _VISIBLE[int(_WORKER[2:]) % len(_VISIBLE)]

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton decides at decoration time whether a kernel runs in its interpreter, so this must be set
# before any test module imports runtime.kernels. CI has no GPU: kernels run interpreted there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker takes its share of the cores, and so do the processes its tests
# start (spark-run, servers): workers of all-core thread pools oversubscribe the machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(arch, quant="Q8_0", skew=0.0, seed=0) -> Path``: a tiny synthetic GGUF, written once
    per argument tuple per session (treat it as read-only)."""
    from sparkpack.repack.synth import write_synthetic

    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("synth")

    def make(arch: str, quant: str = "Q8_0", skew: float | str = 0.0, seed: int = 0) -> Path:
        key = (arch, quant, skew, seed)
        if key not in cache:
            cache[key] = write_synthetic(root / f"{arch}-{quant}-{skew}-{seed}.gguf", arch, "tiny", quant,
                                         seed=seed, skew=skew)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_hf_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    """``make(arch, outtype="f32") -> (hf_dir, gguf)``: a tiny random transformers model
    (tests/hf_tiny.py) and its conversion by repack.convert_hf, built once per session."""
    from sparkpack.repack.convert_hf import convert
    from tests.hf_tiny import make_tiny_hf

    root = tmp_path_factory.mktemp("tiny_hf_gguf")
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(arch: str, outtype: str = "f32") -> tuple[Path, Path]:
        hf_dir = root / arch
        if not (hf_dir / "config.json").exists():
            make_tiny_hf(arch, hf_dir, seed=0)
        if (arch, outtype) not in cache:
            cache[(arch, outtype)] = (hf_dir, convert(hf_dir, root / f"{arch}-{outtype}.gguf", outtype))
        return cache[(arch, outtype)]

    return make


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~100 MB of F16 experts: big enough that a split or join can be stopped half-way."""
    from dataclasses import replace

    from sparkpack.repack.synth import get_preset, write_synthetic

    p = replace(get_preset("qwen3moe", "tiny"), n_layer=8, n_head=(4,) * 8, n_expert=32, n_ff_exp=256)
    return write_synthetic(tmp_path_factory.mktemp("slow") / "slow.gguf", "qwen3moe", p, "F16")


@pytest.fixture
def cli(monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """``cli(*args) -> (exit code, stdout, stderr)``: ``repack ARGS`` in-process through its real
    entry point (tests/commands.py)."""
    from tests.commands import run_repack

    return lambda *a: run_repack(monkeypatch, capsys, *a)
