"""``repack convert-hf`` against tiny random transformers models (tests/hf_tiny.py).

Expectations are derived from the HF config and weights with llama.cpp's documented conventions
(GGUF ``ne`` order is the reverse of PyTorch's, experts stacked last, Qwen3.5 norms stored as
1 + w, ``ssm_a = -exp(A_log)``, DeltaNet value heads in tiled order), never by re-running the
converter's own mapping code.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from sparkpack.formats.archs import model_spec
from sparkpack.formats.gguf_file import GGUFModel

ARCHS = ("qwen3moe", "qwen35moe", "laguna")


# ----------------------------------------------------------------------------- helpers


def _read(path: Path) -> tuple[dict, dict]:
    """(metadata name -> python value, tensor name -> ReaderTensor)."""
    r = gguf.GGUFReader(path)
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    return kv, {t.name: t for t in r.tensors}


def _f32(t) -> np.ndarray:
    """A GGUF tensor as float32 in PyTorch axis order (reverse of ne)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)


def _hf(hf_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((hf_dir / "config.json").read_text())
    return config, load_file(hf_dir / "model.safetensors")


def _n_expert(c: dict) -> int:
    return c.get("num_experts") or c["num_local_experts"]  # Qwen3-MoE saves the latter


def _tiled(n_k: int, n_v: int) -> list[int]:
    """GGUF value-head slot -> HF value head: slot j * n_k + g holds head j of key group g."""
    r = n_v // n_k
    return [g * r + j for j in range(r) for g in range(n_k)]


def _rows(heads: list[int], dim: int) -> list[int]:
    return [h * dim + i for h in heads for i in range(dim)]


def expected_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """GGUF name -> ne (fastest axis first), from the HF config alone."""
    H, V, E = c["hidden_size"], c["vocab_size"], _n_expert(c)
    F, hd, nkv = c["moe_intermediate_size"], c["head_dim"], c["num_key_value_heads"]
    arch = c["architectures"][0]
    n_layer = c["num_hidden_layers"]
    s: dict[str, tuple[int, ...]] = {"token_embd.weight": (H, V), "output_norm.weight": (H,), "output.weight": (H, V)}
    heads = c.get("num_attention_heads_per_layer") or [c["num_attention_heads"]] * n_layer
    for il in range(n_layer):
        p = f"blk.{il}."
        nh = heads[il]
        s[p + "attn_norm.weight"] = (H,)
        linear = arch == "Qwen3_5MoeForCausalLM" and c["layer_types"][il] == "linear_attention"
        if linear:
            nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
            dk, dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
            conv = 2 * nk * dk + nv * dv
            s.update({p + "attn_qkv.weight": (H, conv), p + "attn_gate.weight": (H, nv * dv),
                      p + "ssm_alpha.weight": (H, nv), p + "ssm_beta.weight": (H, nv), p + "ssm_a": (nv,),
                      p + "ssm_dt.bias": (nv,), p + "ssm_conv1d.weight": (K, conv), p + "ssm_norm.weight": (dv,),
                      p + "ssm_out.weight": (nv * dv, H)})
        else:
            q_rows = 2 * nh * hd if arch == "Qwen3_5MoeForCausalLM" else nh * hd  # Qwen3.5: [query | gate]
            s.update({p + "attn_q.weight": (H, q_rows), p + "attn_k.weight": (H, nkv * hd),
                      p + "attn_v.weight": (H, nkv * hd), p + "attn_output.weight": (nh * hd, H),
                      p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if arch == "LagunaForCausalLM":
            s[p + "attn_gate.weight"] = (H, nh)
        s[p + ("post_attention_norm.weight" if arch == "Qwen3_5MoeForCausalLM" else "ffn_norm.weight")] = (H,)
        if arch == "LagunaForCausalLM" and c["mlp_layer_types"][il] == "dense":
            I = c["intermediate_size"]
            s.update({p + "ffn_gate.weight": (H, I), p + "ffn_up.weight": (H, I), p + "ffn_down.weight": (I, H)})
            continue
        s.update({p + "ffn_gate_inp.weight": (H, E), p + "ffn_gate_exps.weight": (H, F, E),
                  p + "ffn_up_exps.weight": (H, F, E), p + "ffn_down_exps.weight": (F, H, E)})
        if "shared_expert_intermediate_size" in c:
            Fs = c["shared_expert_intermediate_size"]
            s.update({p + "ffn_gate_shexp.weight": (H, Fs), p + "ffn_up_shexp.weight": (H, Fs),
                      p + "ffn_down_shexp.weight": (Fs, H)})
        if arch == "Qwen3_5MoeForCausalLM":
            s[p + "ffn_gate_inp_shexp.weight"] = (H, 1)
        if arch == "LagunaForCausalLM":
            s[p + "exp_probs_b.bias"] = (E,)
    return s


def expected_metadata(c: dict, arch: str) -> dict:
    n_layer = c["num_hidden_layers"]
    rope = c["rope_parameters"]
    m = {
        "general.architecture": arch, "general.file_type": 0,
        f"{arch}.block_count": n_layer, f"{arch}.embedding_length": c["hidden_size"],
        f"{arch}.context_length": c["max_position_embeddings"],
        f"{arch}.attention.head_count_kv": c["num_key_value_heads"],
        f"{arch}.attention.key_length": c["head_dim"], f"{arch}.attention.value_length": c["head_dim"],
        f"{arch}.attention.layer_norm_rms_epsilon": pytest.approx(c["rms_norm_eps"]),
        f"{arch}.expert_count": _n_expert(c), f"{arch}.expert_used_count": c["num_experts_per_tok"],
        f"{arch}.expert_feed_forward_length": c["moe_intermediate_size"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": {"qwen3moe": "qwen2", "qwen35moe": "qwen35", "laguna": "laguna"}[arch],
    }
    if arch == "qwen3moe":
        m.update({f"{arch}.attention.head_count": c["num_attention_heads"],
                  f"{arch}.feed_forward_length": c["intermediate_size"],
                  f"{arch}.rope.freq_base": pytest.approx(rope["rope_theta"])})
    if arch == "qwen35moe":
        m.update({
            f"{arch}.attention.head_count": c["num_attention_heads"],
            f"{arch}.rope.freq_base": pytest.approx(rope["rope_theta"]),
            f"{arch}.rope.dimension_count": int(c["head_dim"] * rope["partial_rotary_factor"]),
            f"{arch}.rope.dimension_sections": (rope["mrope_section"] + [0, 0, 0, 0])[:4],
            f"{arch}.expert_shared_feed_forward_length": c["shared_expert_intermediate_size"],
            f"{arch}.ssm.conv_kernel": c["linear_conv_kernel_dim"],
            f"{arch}.ssm.state_size": c["linear_key_head_dim"],
            f"{arch}.ssm.group_count": c["linear_num_key_heads"],
            f"{arch}.ssm.time_step_rank": c["linear_num_value_heads"],
            f"{arch}.ssm.inner_size": c["linear_value_head_dim"] * c["linear_num_value_heads"],
            f"{arch}.full_attention_interval": 4,
            f"{arch}.attention.recurrent_layers": [t == "linear_attention" for t in c["layer_types"]],
        })
    if arch == "laguna":
        m.update({
            f"{arch}.attention.head_count": c["num_attention_heads_per_layer"],
            f"{arch}.feed_forward_length": c["intermediate_size"],
            f"{arch}.vocab_size": c["vocab_size"],
            f"{arch}.attention.sliding_window": c["sliding_window"],
            f"{arch}.leading_dense_block_count": c["mlp_layer_types"].index("sparse"),
            f"{arch}.expert_shared_feed_forward_length": c["shared_expert_intermediate_size"],
            f"{arch}.expert_weights_norm": True,
            f"{arch}.expert_weights_scale": pytest.approx(c["moe_routed_scaling_factor"]),
            f"{arch}.expert_gating_func": 2,
            f"{arch}.rope.freq_base": pytest.approx(rope["full_attention"]["rope_theta"]),
            f"{arch}.rope.freq_base_swa": pytest.approx(rope["sliding_attention"]["rope_theta"]),
            f"{arch}.rope.dimension_count": int(c["head_dim"] * rope["full_attention"]["partial_rotary_factor"]),
            f"{arch}.rope.dimension_count_swa":
                int(c["head_dim"] * rope["sliding_attention"]["partial_rotary_factor"]),
            "tokenizer.ggml.eot_token_id": c["eos_token_id"][1],
        })
    return m


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("arch", ARCHS)
def test_names_shapes_and_metadata(tiny_hf_gguf, arch: str) -> None:
    hf_dir, path = tiny_hf_gguf(arch)
    config, _ = _hf(hf_dir)
    kv, tensors = _read(path)
    want = expected_shapes(config)
    assert {n: tuple(int(d) for d in t.shape) for n, t in tensors.items()} == want
    for key, value in expected_metadata(config, arch).items():
        assert key in kv, key
        assert kv[key] == value, key
    assert all(t.tensor_type == Q.F32 for t in tensors.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_model_spec_reads_converted_file(tiny_hf_gguf, arch: str) -> None:
    hf_dir, path = tiny_hf_gguf(arch)
    config, _ = _hf(hf_dir)
    spec = model_spec(GGUFModel(path))
    assert spec.arch == arch
    assert spec.n_layer == config["num_hidden_layers"] and spec.n_vocab == config["vocab_size"]
    assert spec.n_expert == _n_expert(config) and spec.n_expert_used == config["num_experts_per_tok"]
    assert spec.head_dim == config["head_dim"]
    if arch == "qwen35moe":
        assert [k.attention for k in spec.layers] == ["linear", "linear", "linear", "full"]
    if arch == "laguna":
        assert spec.n_head == config["num_attention_heads_per_layer"]
        assert [k.attention for k in spec.layers] == ["full", "sliding", "sliding", "sliding"]
        assert [k.ffn for k in spec.layers] == ["dense", "moe", "moe", "moe"]
        assert spec.expert_weights_scale == pytest.approx(2.5)


# ----------------------------------------------------------------------------- values


def _check_common_values(tensors: dict, hf: dict[str, np.ndarray], moe_layer: int, close) -> None:
    close(_f32(tensors["token_embd.weight"]), hf["model.embed_tokens.weight"])
    close(_f32(tensors["output.weight"]), hf["lm_head.weight"])
    p, h = f"blk.{moe_layer}.", f"model.layers.{moe_layer}."
    close(_f32(tensors[p + "ffn_gate_inp.weight"]), hf[h + "mlp.gate.weight"])
    for e in (0, 5):
        for w in ("gate", "up", "down"):
            close(_f32(tensors[p + f"ffn_{w}_exps.weight"])[e], hf[h + f"mlp.experts.{e}.{w}_proj.weight"])


def _exact(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a, b.astype(np.float32))


def _q8(a: np.ndarray, b: np.ndarray) -> None:
    # Q8_0: one scale per 32 values, error at most half a step of the block's absmax / 127
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= np.abs(b).max() / 127 + 1e-6


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_qwen3moe_values(tiny_hf_gguf, outtype: str) -> None:
    hf_dir, path = tiny_hf_gguf("qwen3moe", outtype)
    _, hf = _hf(hf_dir)
    _, t = _read(path)
    close = _exact if outtype == "f32" else _q8
    _check_common_values(t, hf, 1, close)
    close(_f32(t["blk.1.attn_q.weight"]), hf["model.layers.1.self_attn.q_proj.weight"])
    _exact(_f32(t["blk.1.attn_q_norm.weight"]), hf["model.layers.1.self_attn.q_norm.weight"])  # no offset
    if outtype == "q8_0":
        assert t["blk.1.attn_q.weight"].tensor_type == Q.Q8_0
        assert t["blk.1.ffn_gate_exps.weight"].tensor_type == Q.Q8_0
        for name in ("blk.1.ffn_gate_inp.weight", "blk.1.attn_norm.weight", "blk.1.attn_k_norm.weight"):
            assert t[name].tensor_type == Q.F32, name


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_qwen35moe_values(tiny_hf_gguf, outtype: str) -> None:
    hf_dir, path = tiny_hf_gguf("qwen35moe", outtype)
    c, hf = _hf(hf_dir)
    _, t = _read(path)
    close = _exact if outtype == "f32" else _q8
    _check_common_values(t, hf, 0, close)
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    heads = _tiled(nk, nv)
    assert heads != list(range(nv))  # the tiny config must exercise the reordering
    h = "model.layers.1.linear_attn."
    qkv = hf[h + "in_proj_qkv.weight"]
    qk = 2 * nk * dk
    v_rows = [qk + r for r in _rows(heads, dv)]
    close(_f32(t["blk.1.attn_qkv.weight"]), qkv[list(range(qk)) + v_rows])
    close(_f32(t["blk.1.attn_gate.weight"]), hf[h + "in_proj_z.weight"][_rows(heads, dv)])
    close(_f32(t["blk.1.ssm_alpha.weight"]), hf[h + "in_proj_a.weight"][heads])
    close(_f32(t["blk.1.ssm_beta.weight"]), hf[h + "in_proj_b.weight"][heads])
    close(_f32(t["blk.1.ssm_out.weight"]), hf[h + "out_proj.weight"][:, _rows(heads, dv)])
    # F32 whatever the outtype: 1-D tensors, norms and the conv kernel
    np.testing.assert_allclose(_f32(t["blk.1.ssm_a"]), -np.exp(hf[h + "A_log"][heads].astype(np.float64)),
                               rtol=1e-6)
    _exact(_f32(t["blk.1.ssm_dt.bias"]), hf[h + "dt_bias"][heads])
    conv = hf[h + "conv1d.weight"][:, 0, :]
    _exact(_f32(t["blk.1.ssm_conv1d.weight"]), conv[list(range(qk)) + v_rows])
    _exact(_f32(t["blk.1.ssm_norm.weight"]), hf[h + "norm.weight"])  # gated norm: no offset
    # (1 + w) norms are stored with the offset applied
    _exact(_f32(t["output_norm.weight"]), hf["model.norm.weight"] + np.float32(1))
    _exact(_f32(t["blk.3.attn_q_norm.weight"]), hf["model.layers.3.self_attn.q_norm.weight"] + np.float32(1))
    _exact(_f32(t["blk.0.post_attention_norm.weight"]),
           hf["model.layers.0.post_attention_layernorm.weight"] + np.float32(1))
    close(_f32(t["blk.3.attn_q.weight"]), hf["model.layers.3.self_attn.q_proj.weight"])
    _exact(_f32(t["blk.0.ffn_gate_inp_shexp.weight"]), hf["model.layers.0.mlp.shared_expert_gate.weight"])
    if outtype == "q8_0":
        for name in ("blk.1.ssm_a", "blk.1.ssm_conv1d.weight", "blk.0.ffn_gate_inp_shexp.weight",
                     "blk.0.ffn_gate_inp.weight", "blk.1.ssm_norm.weight"):
            assert t[name].tensor_type == Q.F32, name
        assert t["blk.1.attn_qkv.weight"].tensor_type == Q.Q8_0


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_laguna_values(tiny_hf_gguf, outtype: str) -> None:
    hf_dir, path = tiny_hf_gguf("laguna", outtype)
    _, hf = _hf(hf_dir)
    _, t = _read(path)
    close = _exact if outtype == "f32" else _q8
    _check_common_values(t, hf, 2, close)
    close(_f32(t["blk.0.ffn_gate.weight"]), hf["model.layers.0.mlp.gate_proj.weight"])
    close(_f32(t["blk.0.attn_q.weight"]), hf["model.layers.0.self_attn.q_proj.weight"])
    close(_f32(t["blk.2.attn_gate.weight"]), hf["model.layers.2.self_attn.g_proj.weight"])
    _exact(_f32(t["blk.2.exp_probs_b.bias"]), hf["model.layers.2.mlp.experts.e_score_correction_bias"])
    _exact(_f32(t["blk.2.attn_norm.weight"]), hf["model.layers.2.input_layernorm.weight"])
    close(_f32(t["blk.2.ffn_down_shexp.weight"]), hf["model.layers.2.mlp.shared_expert.down_proj.weight"])


def test_bf16_checkpoint_is_decoded_exactly(tiny_hf_gguf, tmp_path: Path) -> None:
    """A bf16 checkpoint converts without torch to the exact float32 values of its bf16 weights."""
    import torch
    from safetensors.torch import load_file as load_pt, save_file

    from sparkpack.repack.convert_hf import convert

    src, _ = tiny_hf_gguf("qwen3moe")
    dst = tmp_path / "bf16"
    shutil.copytree(src, dst)
    state = {k: v.to(torch.bfloat16) for k, v in load_pt(src / "model.safetensors").items()}
    save_file(state, dst / "model.safetensors")
    _, t = _read(convert(dst, tmp_path / "bf16.gguf", "bf16"))
    assert t["blk.0.attn_q.weight"].tensor_type == Q.BF16
    for name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                          ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight")):
        _exact(_f32(t[name]), state[hf_name].float().numpy())
    _exact(_f32(t["blk.1.ffn_up_exps.weight"])[6], state["model.layers.1.mlp.experts.6.up_proj.weight"].float().numpy())


def test_fused_expert_checkpoint_gives_same_file(tiny_hf_gguf, tmp_path: Path) -> None:
    """transformers 5 can also save experts fused (gate_up_proj: experts x 2*ff x embd, down_proj:
    experts x embd x ff); both layouts must give the same GGUF tensors."""
    from safetensors.numpy import save_file

    from sparkpack.repack.convert_hf import convert

    src, per_expert = tiny_hf_gguf("qwen3moe")
    c, hf = _hf(src)
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    fused = {k: v for k, v in hf.items() if ".experts." not in k}
    for il in range(c["num_hidden_layers"]):
        p = f"model.layers.{il}.mlp.experts"
        ids = range(_n_expert(c))
        fused[f"{p}.gate_up_proj"] = np.stack(
            [np.concatenate([hf[f"{p}.{e}.gate_proj.weight"], hf[f"{p}.{e}.up_proj.weight"]]) for e in ids])
        fused[f"{p}.down_proj"] = np.stack([hf[f"{p}.{e}.down_proj.weight"] for e in ids])
    save_file(fused, dst / "model.safetensors")
    _, want = _read(per_expert)
    _, got = _read(convert(dst, tmp_path / "fused.gguf"))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(_f32(got[name]), _f32(want[name]), err_msg=name)


def _with_mtp_head(src: Path, dst: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A copy of the tiny Qwen3.5 checkpoint ``src`` with an MTP head as Qwen3.5/3.6 checkpoints
    carry it (``mtp.*``, ``mtp_num_hidden_layers``; its block shaped as the trunk's full-attention
    layers): (config, trunk tensors, head tensors)."""
    from safetensors.numpy import save_file

    c, hf = _hf(src)
    n, e = c["num_hidden_layers"], c["hidden_size"]
    full = f"model.layers.{n - 1}."  # a full-attention layer: the head's block has its shapes
    rng = np.random.default_rng(4)
    mtp = {"mtp.layers.0." + k[len(full):]: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
           for k, v in hf.items() if k.startswith(full)}
    mtp["mtp.fc.weight"] = (0.1 * rng.standard_normal((e, 2 * e))).astype(np.float32)
    for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{k}.weight"] = (0.1 * rng.standard_normal(e)).astype(np.float32)
    shutil.copytree(src, dst)
    save_file({**hf, **mtp}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps({**c, "mtp_num_hidden_layers": 1}))
    return c, hf, mtp


def test_qwen35moe_mtp_head_becomes_the_block_after_the_trunk(tiny_hf_gguf, tmp_path: Path) -> None:
    """A Qwen3.5 checkpoint's ``mtp.*`` head (``mtp_num_hidden_layers``) converts to the block
    llama.cpp's converter appends: ``mtp.layers.0`` under the trunk's names at index
    ``num_hidden_layers``, ``fc``/``pre_fc_norm_*``/``norm`` as its ``nextn.*`` tensors (norms as
    1 + w), the head counted in ``block_count`` and named by ``nextn_predict_layers``: the names
    ``repack synth --mtp`` writes, read back as the spec's head, and drafting."""
    import torch

    from sparkpack.repack.convert_hf import convert
    from sparkpack.repack.synth import write_synthetic
    from sparkpack.runtime.models import load_model
    from sparkpack.runtime.models.mtp import MtpDrafter

    src, _ = tiny_hf_gguf("qwen35moe")
    c, hf, mtp = _with_mtp_head(src, tmp_path / "mtp")
    n = c["num_hidden_layers"]
    dst = tmp_path / "mtp"
    path = convert(dst, tmp_path / "mtp.gguf")
    kv, t = _read(path)
    assert kv["qwen35moe.block_count"] == n + 1 and kv["qwen35moe.nextn_predict_layers"] == 1
    b = f"blk.{n}."
    with GGUFModel(write_synthetic(tmp_path / "synth.gguf", "qwen35moe", "tiny", "F32", mtp=True)) as synth:
        assert {k for k in t if k.startswith(b)} == {k for k in synth.tensors if k.startswith(b)}
    _exact(_f32(t[b + "nextn.eh_proj.weight"]), mtp["mtp.fc.weight"])
    for gguf_name, hf_name in (("nextn.enorm", "pre_fc_norm_embedding"), ("nextn.hnorm", "pre_fc_norm_hidden"),
                               ("nextn.shared_head_norm", "norm")):
        _exact(_f32(t[f"{b}{gguf_name}.weight"]), mtp[f"mtp.{hf_name}.weight"] + np.float32(1))
    _exact(_f32(t[b + "attn_norm.weight"]), mtp["mtp.layers.0.input_layernorm.weight"] + np.float32(1))
    _exact(_f32(t[b + "attn_q.weight"]), mtp["mtp.layers.0.self_attn.q_proj.weight"])
    _exact(_f32(t[b + "ffn_down_exps.weight"])[3], mtp["mtp.layers.0.mlp.experts.3.down_proj.weight"])
    _exact(_f32(t[b + "ffn_gate_inp_shexp.weight"]), mtp["mtp.layers.0.mlp.shared_expert_gate.weight"])
    with GGUFModel(path) as m:
        spec = model_spec(m)
        assert spec.n_layer == n and spec.nextn.layers == (n,)
    model = load_model(path, dtype=torch.float64)
    ids = list(range(3, 12))
    assert len(MtpDrafter(model).propose(ids, 3, model.forward_hidden(ids[:-1])[1])) == 3


def test_qwen35moe_mtp_head_forward_matches_transformers_modules(tiny_hf_gguf, tmp_path: Path) -> None:
    """The converted head's forward (``MTPHead``, float64) against the MTP predictor as vLLM's
    ``Qwen3NextMultiTokenPredictor`` composes it, built from transformers' own Qwen3.5-MoE modules
    on the checkpoint's ``mtp.*`` tensors: ``fc(cat(pre_fc_norm_embedding(embed(x)),
    pre_fc_norm_hidden(h)))``, one full-attention ``Qwen3_5MoeDecoderLayer``, ``norm``, the
    model's ``lm_head``; causal over rows at positions 0..T-1."""
    import torch
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_mod

    from sparkpack.repack.convert_hf import convert
    from sparkpack.runtime.models import load_model

    src, _ = tiny_hf_gguf("qwen35moe")
    c, hf, mtp = _with_mtp_head(src, tmp_path / "mtp")
    n, e = c["num_hidden_layers"], c["hidden_size"]
    config = Qwen3_5MoeTextConfig(**{k: v for k, v in c.items() if k not in ("architectures", "transformers_version")},
                                  attn_implementation="eager")
    full = next(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    t64 = {k: torch.from_numpy(v).double() for k, v in mtp.items()}
    layer = hf_mod.Qwen3_5MoeDecoderLayer(config, full).double().eval()
    block = {k[len("mtp.layers.0."):]: v for k, v in t64.items() if k.startswith("mtp.layers.0.")}
    p, experts = "mlp.experts.", range(_n_expert(c))
    fused = {p + "gate_up_proj": torch.stack([torch.cat([block.pop(f"{p}{x}.gate_proj.weight"),
                                                         block.pop(f"{p}{x}.up_proj.weight")]) for x in experts]),
             p + "down_proj": torch.stack([block.pop(f"{p}{x}.down_proj.weight") for x in experts])}
    layer.load_state_dict({**block, **fused})
    norms = {}
    for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[k] = hf_mod.Qwen3_5MoeRMSNorm(e, eps=c["rms_norm_eps"]).double()
        norms[k].load_state_dict({"weight": t64[f"mtp.{k}.weight"]})
    rotary = hf_mod.Qwen3_5MoeTextRotaryEmbedding(config)

    g = torch.Generator().manual_seed(6)
    T = 7
    ids = torch.randint(0, c["vocab_size"], (T,), generator=g)
    hidden = torch.randn(T, e, generator=g, dtype=torch.float64)
    with torch.no_grad():
        embed = torch.from_numpy(hf["model.embed_tokens.weight"]).double()[ids]
        u = torch.cat([norms["pre_fc_norm_embedding"](embed), norms["pre_fc_norm_hidden"](hidden)], -1) \
            @ t64["mtp.fc.weight"].T
        pos = torch.arange(T).view(1, 1, T).expand(3, 1, T)
        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        out = layer(u[None], rotary(u[None], pos), attention_mask=mask, position_ids=pos[0])
        out = norms["norm"](out[0] if isinstance(out, tuple) else out)[0]
        want = out @ torch.from_numpy(hf["lm_head.weight"]).double().T
    model = load_model(convert(tmp_path / "mtp", tmp_path / "mtp.gguf"), dtype=torch.float64)
    head = model.load_mtp()
    logits, normed = head.forward(ids.tolist(), hidden, head.new_cache())
    rel = lambda a, b: float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())  # noqa: E731
    assert rel(normed, out) < 1e-6 and rel(logits, want) < 1e-6, (rel(normed, out), rel(logits, want))


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_metadata_matches_hf(tiny_hf_gguf, arch: str) -> None:
    from tokenizers import Tokenizer

    hf_dir, path = tiny_hf_gguf(arch)
    config, _ = _hf(hf_dir)
    kv, _ = _read(path)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == config["vocab_size"]
    for text, i in vocab.items():
        assert tokens[i] == text
    assert tokens[len(vocab):] == [f"[PAD{i}]" for i in range(len(vocab), config["vocab_size"])]
    merges = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert kv["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in merges]
    types = kv["tokenizer.ggml.token_type"]
    for special in ("<|endoftext|>",) + (("<|im_end|>",) if arch != "laguna" else ("</assistant>",)):
        assert types[vocab[special]] == gguf.TokenType.CONTROL
    assert types[vocab["Ġthe"]] == gguf.TokenType.NORMAL
    assert types[-1] == gguf.TokenType.UNUSED
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert kv["tokenizer.chat_template"] == tcfg["chat_template"]
    assert kv["tokenizer.ggml.eos_token_id"] == vocab[tcfg["eos_token"]]


# ----------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "convert-hf", *args],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])


def test_cli_converts(tiny_hf_gguf, tmp_path: Path) -> None:
    hf_dir, _ = tiny_hf_gguf("laguna")
    out = tmp_path / "sub" / "l.gguf"
    # outputs go into folders that exist (the rule of every repack command, repack/outputs.py)
    _one_line_error(_cli(str(hf_dir), "-o", str(out), "--outtype", "f16"), str(out), "does not exist")
    out.parent.mkdir()
    r = _cli(str(hf_dir), "-o", str(out), "--outtype", "f16")
    assert r.returncode == 0, r.stderr
    _, t = _read(out)
    assert t["blk.1.ffn_gate_exps.weight"].tensor_type == Q.F16
    assert t["blk.1.ffn_gate_inp.weight"].tensor_type == Q.F32
    assert [p.name for p in out.parent.iterdir()] == ["l.gguf"]  # no temporary left behind


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("repack: error: ")
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_unsupported_architecture(tiny_hf_gguf, tmp_path: Path) -> None:
    hf_dir, _ = tiny_hf_gguf("qwen3moe")
    bad = tmp_path / "llama"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "x.gguf"
    _one_line_error(_cli(str(bad), "-o", str(out)), "LlamaForCausalLM", "not supported")
    assert not out.exists()


def test_cli_missing_safetensors(tiny_hf_gguf, tmp_path: Path) -> None:
    hf_dir, _ = tiny_hf_gguf("qwen3moe")
    bad = tmp_path / "noweights"
    shutil.copytree(hf_dir, bad)
    (bad / "model.safetensors").unlink()
    _one_line_error(_cli(str(bad), "-o", str(tmp_path / "x.gguf")), "safetensors")
    # a sharded checkpoint whose index names a shard that is not there
    (bad / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    _one_line_error(_cli(str(bad), "-o", str(tmp_path / "x.gguf")), "model-00001-of-00002.safetensors", "missing")


def test_cli_not_a_model_dir(tmp_path: Path) -> None:
    _one_line_error(_cli(str(tmp_path / "nope"), "-o", str(tmp_path / "x.gguf")), "not a directory")
    _one_line_error(_cli(str(tmp_path), "-o", str(tmp_path / "x.gguf")), "config.json")


# ----------------------------------------------------------------------------- the tiny factory


def test_tiny_model_routing_is_not_trivial(tiny_hf_gguf) -> None:
    """The factory's weight scale must make routing depend on the token, or a runtime that picks
    the wrong experts would still match the reference."""
    import torch

    from tests.hf_tiny import load_tiny_hf

    hf_dir, _ = tiny_hf_gguf("qwen3moe")
    model = load_tiny_hf(hf_dir)
    assert not model.training and next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        out = model(torch.arange(3, 35)[None], output_router_logits=True)
    router = out.router_logits[0].reshape(32, -1)
    top = router.topk(2, dim=-1)
    assert len(set(top.indices.flatten().tolist())) >= 6  # most of the 8 experts get used
    assert float((top.values[:, 0] - top.values[:, 1]).mean()) > 0.05  # choices are not ties
