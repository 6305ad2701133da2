"""Arch specs and expert byte ranges on hand-built GGUFs whose bytes we control exactly.

The files hold only expert tensors and the embeddings, so specs are built without the shape check
of the full tensor table (``build_spec``; tests/test_metadata_checks.py checks shapes)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from sparkpack.formats.archs import DENSE, FULL, LINEAR, MOE, SLIDING, build_spec as model_spec
from sparkpack.formats.errors import FormatError, UnsupportedError
from sparkpack.formats.experts import expert_bytes, expert_nbytes, expert_slices
from sparkpack.formats.gguf_file import GGUFModel

N_EXPERT, N_EMBD, N_FF = 4, 32, 16


def _write(path: Path, arch: str, n_layer: int, extra_kv: dict, layers_with_experts: list[int],
           merged: bool = False) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_embedding_length(N_EMBD)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(N_FF)
    w.add_vocab_size(50)
    for k, v in extra_kv.items():
        if isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", v)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((50, N_EMBD), dtype=np.float32))
    for il in layers_with_experts:
        # Each expert's values encode (layer, expert) so byte ranges can be checked exactly.
        def stack(rows, cols):
            return np.stack([np.full((rows, cols), il * 100 + e, np.float32) for e in range(N_EXPERT)])
        if merged:
            w.add_tensor(f"blk.{il}.ffn_gate_up_exps.weight", stack(2 * N_FF, N_EMBD))
        else:
            w.add_tensor(f"blk.{il}.ffn_gate_exps.weight", stack(N_FF, N_EMBD))
            w.add_tensor(f"blk.{il}.ffn_up_exps.weight", stack(N_FF, N_EMBD))
        w.add_tensor(f"blk.{il}.ffn_down_exps.weight", stack(N_EMBD, N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_expert_slices_are_the_experts_bytes(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "qwen3moe", 2, {}, [0, 1])
    with GGUFModel(path) as m:
        spec = model_spec(m)
        assert spec.moe_layers == [0, 1]
        assert expert_nbytes(m, spec, 1) == (2 * N_FF * N_EMBD + N_EMBD * N_FF) * 4
        for il in (0, 1):
            for e in range(N_EXPERT):
                roles = [s.role for s in expert_slices(m, spec, il, e)]
                assert roles == ["gate", "up", "down"]
                for view in expert_bytes(m, spec, il, e):
                    vals = np.frombuffer(view.tobytes(), np.float32)
                    assert np.all(vals == il * 100 + e)


def test_merged_gate_up_is_found(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "qwen3moe", 1, {}, [0], merged=True)
    with GGUFModel(path) as m:
        spec = model_spec(m)
        assert set(spec.expert_tensors[0]) == {"gate_up", "down"}
        vals = np.frombuffer(expert_bytes(m, spec, 0, 3)[0].tobytes(), np.float32)
        assert np.all(vals == 3)


def test_laguna_layer_pattern_and_leading_dense(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "laguna", 6,
                  {"attention.sliding_window": 8, "leading_dense_block_count": 1}, [1, 2, 3, 4, 5])
    with GGUFModel(path) as m:
        spec = model_spec(m)
    assert [k.attention for k in spec.layers] == [FULL, SLIDING, SLIDING, SLIDING, FULL, SLIDING]
    assert [k.ffn for k in spec.layers] == [DENSE] + [MOE] * 5
    assert spec.router == "sigmoid"


def test_qwen35moe_hybrid_pattern_excludes_mtp_layers(tmp_path: Path) -> None:
    ssm = {"ssm.conv_kernel": 4, "ssm.inner_size": 64, "ssm.state_size": 16,
           "ssm.time_step_rank": 4, "ssm.group_count": 2, "nextn_predict_layers": 1}
    path = _write(tmp_path / "m.gguf", "qwen35moe", 9, ssm, list(range(9)))
    with GGUFModel(path) as m:
        spec = model_spec(m)
    assert spec.n_layer == 8
    assert [k.attention for k in spec.layers] == [LINEAR, LINEAR, LINEAR, FULL] * 2


def test_missing_expert_tensors_is_a_clear_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "qwen3moe", 2, {}, [0])
    with GGUFModel(path) as m, pytest.raises(FormatError, match="layer 1 is a MoE layer"):
        model_spec(m)


def test_non_moe_arch_is_unsupported(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "llama", 1, {}, [0])
    with GGUFModel(path) as m, pytest.raises(UnsupportedError, match="not a mixture-of-experts"):
        model_spec(m)
