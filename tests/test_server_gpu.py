"""The server on a GPU (run on the GPU machine with SPARKPACK_TEST_DEVICE=cuda; skipped without
CUDA): with the expert store at partial residency, CUDA graphs and (qwen35moe) DeltaNet
checkpoints in pinned host memory, a follow-up turn that reuses the cached prefix gives the bits
and greedy tokens of a fresh server's first request, and a first turn gives spark-run -p's tokens."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch

from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.tokenizer import GGUFTokenizer
from tests.serve_proc import API_KEY, ENV, ServerProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# --no-learn: the models are the session's shared ones, no profile is written beside them
ARGS = ["--hot-fraction", "0.5", "--cache-slots", "4", "--ctx", "1024", "--prefill-chunk", "64", "--no-learn"]
SYSTEM = "You are a coding agent. " * 20
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test in utils.py."}]


def chat(server: ServerProcess, messages: list[dict], n: int):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)
    return client.chat.completions.create(model="x", messages=messages, max_tokens=n)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3moe", "laguna"])
def test_gpu_server_reuse_is_exact_and_greedy_is_spark_run_p(synth_model, arch, tmp_path):
    model = synth_model(arch, "Q4_K_M", skew=1.0)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    server = ServerProcess(model, *ARGS, hooks=a, device="cuda")
    try:
        first = chat(server, TURN1, 16)
        turn2 = TURN1 + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Now run the tests."}]
        second = chat(server, turn2, 16)
        # turn 1's calls end before its last control tokens: all but its last few are kept
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 64 // 8 - 8
        metrics = httpx.get(server.base + "/metrics").text
        for served in ("hot", "missed"):  # half the experts on the GPU: both kinds of routings happen
            value = re.search(rf'sparkpack_expert_routings_total{{served="{served}"}} (\S+)', metrics).group(1)
            assert float(value) > 0, served
        assert re.search(r"sparkpack_vram_peak_bytes (\S+)", metrics).group(1) != "0.0"
    finally:
        assert server.stop() == 0
    fresh = ServerProcess(model, *ARGS, hooks=b, device="cuda")
    try:
        chat(fresh, turn2, 16)
    finally:
        assert fresh.stop() == 0
    assert np.array_equal(np.load(a / "2.npy"), np.load(b / "1.npy"))
    assert json.loads((a / "2.json").read_text()) == json.loads((b / "1.json").read_text())
    run = subprocess.run([sys.executable, "-m", "sparkpack.runtime.cli", str(model), "-p", TURN1[1]["content"],
                          "--system", SYSTEM, "--temperature", "0", "--max-tokens", "16", "--device", "cuda", *ARGS],
                         capture_output=True, text=True, check=True, env=ENV)
    tok = GGUFTokenizer.from_metadata(GGUFModel(model))
    assert run.stdout == tok.decode(json.loads((a / "1.json").read_text())["tokens"], skip_special=True) + "\n"
