"""Hyperparameters of the wrong type or value, and shapes that disagree with them: one line naming
the key or tensor, from ``repack inspect`` and ``spark-run`` alike (never a torch error)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import FormatError
from sparkpack.formats.gguf_file import GGUFModel
from tests.gguf_edit import DROP, rewrite

REPO = Path(__file__).resolve().parents[1]
T = gguf.GGUFValueType

BAD = [
    # (arch, edits, words of the one-line error)
    ("qwen3moe", {"qwen3moe.block_count": ("forty", T.STRING)}, "block_count is the string 'forty'"),
    ("qwen3moe", {"qwen3moe.block_count": 2**31 - 1}, "cannot hold them"),
    ("qwen3moe", {"qwen3moe.block_count": 16_000_000}, "cannot hold them"),
    ("qwen3moe", {"qwen3moe.expert_count": ([8, 8], T.ARRAY, T.UINT32)}, "expert_count is an array"),
    ("qwen3moe", {"qwen3moe.attention.layer_norm_rms_epsilon": math.nan}, "layer_norm_rms_epsilon is nan"),
    ("qwen3moe", {"qwen3moe.rope.freq_base": math.inf}, "rope.freq_base is inf"),
    ("qwen3moe", {"qwen3moe.expert_used_count": 0}, "expert_used_count is 0"),
    ("qwen3moe", {"qwen3moe.expert_used_count": 999}, "bad expert counts"),
    ("qwen3moe", {"qwen3moe.expert_weights_norm": ("yes", T.STRING)}, "expected true or false"),
    ("qwen3moe", {"qwen3moe.attention.head_count": 3}, "attention heads for"),
    ("qwen3moe", {"qwen3moe.attention.head_count": 8, "qwen3moe.attention.head_count_kv": 8}, "has shape"),
    ("qwen3moe", {"qwen3moe.embedding_length": (64, T.UINT32)}, "has shape"),
    ("qwen3moe", {"qwen3moe.rope.dimension_count": (7, T.UINT32)}, "rotary width 7"),
    ("qwen35moe", {"qwen35moe.full_attention_interval": 0}, "full_attention_interval is 0"),
    ("qwen35moe", {"qwen35moe.ssm.inner_size": 32 * 3}, "DeltaNet sizes disagree"),
    ("qwen35moe", {"qwen35moe.ssm.conv_kernel": DROP}, "missing metadata key qwen35moe.ssm.conv_kernel"),
    ("qwen35moe", {"qwen35moe.ssm.state_size": 16, "qwen35moe.ssm.inner_size": 16 * 4}, "has shape"),
    ("laguna", {"laguna.leading_dense_block_count": 99}, "leading_dense_block_count is 99"),
    ("laguna", {"laguna.rope.scaling.type": ("yarn", T.STRING)}, "missing metadata key laguna.rope.scaling.factor"),
    ("laguna", {"laguna.rope.scaling.type": ("yarn", T.STRING), "laguna.rope.scaling.factor": (-2.0, T.FLOAT32),
                "laguna.rope.scaling.original_context_length": (4096, T.UINT32)}, "rope.scaling.factor is -2.0"),
]


@pytest.mark.parametrize("arch, edits, needle", BAD, ids=[f"{a}-{'+'.join(e)}" for a, e, _ in BAD])
def test_bad_hyperparameter_is_one_line(synth_model, tmp_path, monkeypatch, capsys, arch, edits, needle):
    from sparkpack.repack.cli import main

    bad = rewrite(synth_model(arch), tmp_path / "bad.gguf", edits)
    with pytest.raises(FormatError, match=None) as e, GGUFModel(bad) as m:
        model_spec(m)
    assert needle in str(e.value), str(e.value)
    monkeypatch.setattr(sys, "argv", ["repack", "inspect", str(bad)])  # the real entry point, in-process
    with pytest.raises(SystemExit) as exit_:
        main()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exit_.value.code == 1 and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.slow
def test_inconsistent_shapes_stop_spark_run_at_load(synth_model, tmp_path):
    """A file whose head count disagrees with its projections used to run into a torch
    RuntimeError in the attention; now it stops at load with the tensor named."""
    bad = rewrite(synth_model("qwen3moe"), tmp_path / "bad.gguf", {"qwen3moe.attention.head_count": 8,
                                                                    "qwen3moe.attention.head_count_kv": 8})
    r = subprocess.run([sys.executable, "-m", "sparkpack.runtime.cli", str(bad), "--prompt-ids", "1,2,3",
                        "--max-tokens", "1", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and "tensor blk.0.attn_q.weight has shape" in lines[0], lines


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe", "laguna"])
def test_real_layouts_pass_the_shape_table(synth_model, tiny_hf_gguf, arch):
    """The table matches what llama.cpp's converter writes (tiny transformers models converted)
    and what the synthetic writer produces."""
    for path in (synth_model(arch, quant="Q4_K_M"), tiny_hf_gguf(arch)[1]):
        with GGUFModel(path) as m:
            model_spec(m)
