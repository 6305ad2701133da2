"""Synthetic models: real shapes and metadata per arch, a working tokenizer and chat template,
routing skew, determinism, the CLI, and bounded memory while streaming."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import numpy as np
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from sparkpack.formats.archs import LINEAR, MOE, model_spec
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.repack.cli import cli
from sparkpack.repack.synth import write_synthetic
from sparkpack.repack.synth import writer as synth_writer
from sparkpack.repack.synth.metadata import chat_template
from sparkpack.repack.synth.presets import PRESETS, get_preset
from sparkpack.repack.synth.tensors import tensor_plan
from sparkpack.repack.synth.vocab import build_vocab

ARCHS = ["qwen35moe", "laguna", "qwen3moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_matches_preset(synth_model, arch: str) -> None:
    p = get_preset(arch, "tiny")
    with GGUFModel(synth_model(arch)) as m:
        spec = model_spec(m)
        assert (spec.n_layer, spec.n_embd, spec.n_vocab) == (p.n_layer, p.n_embd, p.n_vocab)
        assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp, spec.n_ff_shexp) == (
            p.n_expert, p.n_expert_used, p.n_ff_exp, p.n_ff_shexp)
        assert spec.n_head == list(p.n_head) and spec.head_dim == p.head_dim
        for t in tensor_plan(p):
            assert m.tensors[t.name].shape == t.shape
        assert len(m.tensors) == len(tensor_plan(p))
        assert m.get("tokenizer.ggml.model") == "gpt2"
        assert len(m.get("tokenizer.ggml.tokens")) == p.n_vocab


def test_layer_patterns(synth_model) -> None:
    with GGUFModel(synth_model("qwen35moe")) as m:
        assert [k.attention == LINEAR for k in model_spec(m).layers] == [True, True, True, False]
        assert m.get("qwen35moe.rope.dimension_sections") == [3, 3, 2, 0]
    with GGUFModel(synth_model("laguna")) as m:
        spec = model_spec(m)
        assert [k.ffn == MOE for k in spec.layers] == [False, True, True, True, True]
        assert "blk.0.ffn_gate.weight" in m.tensors and "blk.0.ffn_gate_exps.weight" not in m.tensors
        assert m.get("laguna.expert_gating_func") == 2 and m.get("tokenizer.ggml.eot_token_id") == 24


# Shapes llama.cpp's loaders create (src/models/*.cpp load_arch_tensors) for the full-size models.
FULL_SHAPES = {
    ("qwen35moe", "qwen3.6-35b-a3b"): {
        "token_embd.weight": (2048, 248320), "blk.0.attn_qkv.weight": (2048, 8192),
        "blk.0.attn_gate.weight": (2048, 4096), "blk.0.ssm_conv1d.weight": (4, 8192), "blk.0.ssm_a": (32,),
        "blk.0.ssm_beta.weight": (2048, 32), "blk.0.ssm_norm.weight": (128,), "blk.0.ssm_out.weight": (4096, 2048),
        "blk.3.attn_q.weight": (2048, 8192), "blk.3.attn_k.weight": (2048, 512), "blk.3.attn_output.weight": (4096, 2048),
        "blk.3.attn_q_norm.weight": (256,), "blk.39.ffn_gate_exps.weight": (2048, 512, 256),
        "blk.39.ffn_down_exps.weight": (512, 2048, 256), "blk.39.ffn_gate_inp_shexp.weight": (2048,),
        "blk.39.ffn_down_shexp.weight": (512, 2048),
    },
    ("laguna", "laguna-xs2"): {
        "blk.0.attn_q.weight": (2048, 6144), "blk.1.attn_q.weight": (2048, 8192), "blk.1.attn_output.weight": (8192, 2048),
        "blk.0.attn_gate.weight": (2048, 48), "blk.0.ffn_gate.weight": (2048, 8192), "blk.0.ffn_down.weight": (8192, 2048),
        "blk.1.exp_probs_b.bias": (256,), "blk.1.ffn_up_exps.weight": (2048, 512, 256),
        "blk.1.ffn_gate_shexp.weight": (2048, 512), "token_embd.weight": (2048, 100352),
    },
    ("qwen3moe", "qwen3-30b-a3b"): {
        "blk.0.attn_q.weight": (2048, 4096), "blk.0.attn_k.weight": (2048, 512), "blk.47.attn_output.weight": (4096, 2048),
        "blk.47.ffn_down_exps.weight": (768, 2048, 128), "blk.0.ffn_gate_inp.weight": (2048, 128),
        "output.weight": (2048, 151936),
    },
}


@pytest.mark.parametrize("key", list(FULL_SHAPES), ids=lambda k: k[1])
def test_full_size_tensor_shapes(key: tuple[str, str]) -> None:
    plan = {t.name: t.shape for t in tensor_plan(PRESETS[key])}
    for name, shape in FULL_SHAPES[key].items():
        assert plan[name] == shape, name
    n_params = sum(int(np.prod(s)) for s in plan.values())
    expected = {"qwen3.6-35b-a3b": 34.7e9, "laguna-xs2": 33.4e9, "qwen3-30b-a3b": 30.5e9}[key[1]]
    assert abs(n_params - expected) / expected < 0.01


def _hf_tokenizer(path: Path) -> Tokenizer:
    with GGUFModel(path) as m:
        tokens = m.get("tokenizer.ggml.tokens")
        merges = [tuple(x.split(" ")) for x in m.get("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.mark.parametrize("arch", ["qwen3moe", "laguna"])
def test_tokenizer_round_trips(synth_model, arch: str) -> None:
    tok = _hf_tokenizer(synth_model(arch))
    text = "Hello world, the model routes tokens to experts: naïve café ✓ 1234!\n\tdef main(): pass"
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    assert len(tok.encode(" the").ids) == 1 and len(tok.encode(" function").ids) == 1
    assert len(enc.ids) < len(text.encode())  # merges actually apply


def test_full_vocab_special_ids() -> None:
    p = get_preset("qwen35moe", "qwen3.6-35b-a3b")
    v = build_vocab("qwen", p.n_vocab, p.special_start, "qwen35")
    assert len(v.tokens) == 248320 and len(v.token_types) == 248320
    assert v.tokens[v.eos_id] == "<|im_end|>" and v.eos_id == 248046
    q3 = build_vocab("qwen", 151936, 151643, "qwen2")
    assert (q3.bos_id, q3.eos_id) == (151643, 151645) and q3.tokens[151657] == "<tool_call>"


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18C, sunny"},
    {"role": "assistant", "content": "18C and sunny."},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("arch, markers", [
    ("qwen35moe", ["<|im_start|>system\nYou are terse.", "get_weather", '"arguments": {"city": "Paris"}',
                   "<tool_response>\n18C, sunny\n</tool_response>", "<|im_start|>assistant\n18C and sunny.<|im_end|>"]),
    ("laguna", ["〈|EOS|〉<system>\nYou are terse.", "<tool_call>get_weather<arg_key>city</arg_key>",
                "<tool_response>\n18C, sunny", "18C and sunny.</assistant>"]),
])
def test_chat_template_renders_tools(synth_model, arch: str, markers: list[str]) -> None:
    with GGUFModel(synth_model(arch)) as m:
        source = m.get("tokenizer.chat_template")
        bos = m.get("tokenizer.ggml.tokens")[m.get("tokenizer.ggml.bos_token_id")]
    assert source == chat_template(arch)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.policies["json.dumps_kwargs"] = {"ensure_ascii": False}
    out = env.from_string(source).render(messages=CONVERSATION, tools=TOOLS, add_generation_prompt=True,
                                         bos_token=bos)
    for marker in markers:
        assert marker in out, (marker, out)
    plain = env.from_string(source).render(messages=CONVERSATION[1:2], add_generation_prompt=True, bos_token=bos)
    assert "tool" not in plain and "Weather in Paris?" in plain


def _router_log_norm_spread(path: Path) -> float:
    with GGUFModel(path) as m:
        t = m.tensor("blk.1.ffn_gate_inp.weight")
        w = np.frombuffer(m.raw(t.name).tobytes(), np.float32).reshape(t.shape[1], t.shape[0])
    return float(np.std(np.log(np.linalg.norm(w, axis=1))))


def test_skew_spreads_router_rows(synth_model) -> None:
    flat = _router_log_norm_spread(synth_model("qwen3moe"))
    skewed = _router_log_norm_spread(synth_model("qwen3moe", skew=2.0))
    assert flat < 0.15 and skewed > 5 * flat


def test_same_seed_same_file_and_jobs_do_not_matter(tmp_path: Path, monkeypatch) -> None:
    a = write_synthetic(tmp_path / "a.gguf", "qwen35moe", quant="Q4_K_M", seed=3)
    monkeypatch.setattr(synth_writer, "PARALLEL_MIN_BYTES", 0)
    b = write_synthetic(tmp_path / "b.gguf", "qwen35moe", quant="Q4_K_M", seed=3, jobs=2)
    c = write_synthetic(tmp_path / "c.gguf", "qwen35moe", quant="Q4_K_M", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert not list(tmp_path.glob(".*tmp"))  # temp files renamed away


def test_cli_writes_and_rejects_bad_combinations(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(cli, ["synth", "--arch", "laguna", "--quant", "Q5_K_M", "--skew", "reference",
                                 "-j", "1", "-o", str(out)])
    assert r.exit_code == 0, r.output
    with GGUFModel(out) as m:
        assert "preset=tiny quant=Q5_K_M" in m.get("sparkpack.synthetic")
    proc = subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "synth", "--arch", "qwen3moe", "--preset",
                           "laguna-xs2", "-o", str(tmp_path / "x.gguf")], capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"repack: error: {tmp_path / 'x.gguf'}: preset 'laguna-xs2' does not exist for arch 'qwen3moe' "
        f"(valid: qwen3-30b-a3b, tiny)"]
    assert not (tmp_path / "x.gguf").exists()


def test_types_of_a_real_file_replace_the_mix(synth_model, tmp_path: Path) -> None:
    """``--types-of`` (dynamic quants): every tensor takes the type the given file's header
    gives it, and its file type; a file of another model is one line naming it."""
    like = synth_model("qwen35moe", "IQ2_M")
    out = tmp_path / "like.gguf"
    r = CliRunner().invoke(cli, ["synth", "--arch", "qwen35moe", "--types-of", str(like), "--seed", "3", "-j", "1",
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    with GGUFModel(like) as a, GGUFModel(out) as b:
        assert {n: t.qtype for n, t in a.tensors.items()} == {n: t.qtype for n, t in b.tensors.items()}
        assert b.get("general.file_type") == a.get("general.file_type") and "types-of:" in b.get("sparkpack.synthetic")
    other = synth_model("qwen3moe", "Q8_0")
    proc = subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "synth", "--arch", "qwen35moe", "--types-of",
                           str(other), "-o", str(tmp_path / "x.gguf")], capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(other) in lines[0] and "has no tensor" in lines[0], lines
    assert not (tmp_path / "x.gguf").exists()


MEDIUM_WRITER = textwrap.dedent("""
    import json, sys
    from dataclasses import replace
    from sparkpack.repack.synth import write_synthetic
    from sparkpack.repack.synth.presets import get_preset
    p = replace(get_preset("qwen3moe", "tiny"), name="medium", n_embd=1024, n_expert=64, n_ff_exp=1024,
                n_vocab=4096, special_start=3000)
    path = write_synthetic(sys.argv[1], "qwen3moe", p, "Q4_K_M")
    # VmHWM, not ru_maxrss: rusage survives exec, so a child forked from a big pytest process
    # would report the parent's size; the mm's high-water mark starts fresh at exec.
    kib = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))
    print(json.dumps({"peak_rss": kib * 1024, "size": path.stat().st_size}))
""")


@pytest.mark.slow
def test_streaming_keeps_memory_bounded(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", MEDIUM_WRITER, str(tmp_path / "medium.gguf")],
                          capture_output=True, text=True, check=True)
    r = json.loads(proc.stdout)
    assert r["size"] > 400 * 2**20
    # interpreter + numpy/gguf baseline is ~100 MiB; holding the tensors would need > the file size
    assert r["peak_rss"] < 200 * 2**20, r
    assert r["peak_rss"] < r["size"] / 2


LOW_BIT = ["Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ3_XXS", "IQ3_S", "IQ3_M", "IQ2_M", "IQ2_S",
           "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "Q4_1", "Q5_1"]


def _header_only_f16(path: Path, arch: str, preset: str) -> list:
    """An F16 GGUF of ``preset``'s real tensor list (what llama-quantize starts from) whose data is
    left sparse: ``repack synth``'s header and index, without the bytes. Returns the plan."""
    import gguf

    from sparkpack.formats.quant_mix import mix_qtypes
    from sparkpack.repack.synth.metadata import add_metadata

    p = get_preset(arch, preset)
    plans = tensor_plan(p)
    w = gguf.GGUFWriter(str(path), arch)
    add_metadata(w, p, "F16", 0.0, 0)
    synth_writer.write_index(w, plans, mix_qtypes([(t.name, t.shape) for t in plans], "F16", p.n_layer,
                                                  p.n_head[0] // p.n_head_kv))
    w.close()
    return plans


@pytest.mark.parametrize("arch, preset", [("qwen35moe", "qwen3.6-35b-a3b"), ("laguna", "laguna-xs2"),
                                          ("qwen3moe", "qwen3-30b-a3b"), ("qwen35moe", "tiny")])
def test_llama_quantize_picks_the_types_synth_writes(tmp_path: Path, arch: str, preset: str) -> None:
    """The referee of every mix: llama.cpp's own llama-quantize (``--dry-run``: the per-tensor
    types without quantizing) on an F16 file of the preset's real tensors gives each tensor the
    type ``repack synth --quant`` writes, for every file type synth takes. With an importance
    matrix, as llama.cpp requires for the IQ1/IQ2 types and the hubs' low-bit files are made
    (without one, IQ3_XXS keeps more bits in attn_v and ffn_down). Needs a llama.cpp
    ``llama-quantize`` binary in SPARKPACK_LLAMA_QUANTIZE."""
    import os
    import re
    import struct

    from sparkpack.formats.quant_mix import MIXES, mix_qtypes

    exe = os.environ.get("SPARKPACK_LLAMA_QUANTIZE")
    if not exe:
        pytest.skip("SPARKPACK_LLAMA_QUANTIZE is not set (path to a llama.cpp llama-quantize binary); "
                    "test_quant_blocks checks the rules one by one")
    f16 = tmp_path / "f16.gguf"
    plans = _header_only_f16(f16, arch, preset)
    imatrix = tmp_path / "imatrix.dat"  # (llama.cpp's legacy format: one entry of no tensor here)
    name = b"unused.weight"
    imatrix.write_bytes(struct.pack("<ii", 1, len(name)) + name + struct.pack("<iif", 1, 1, 1.0))
    p = get_preset(arch, preset)
    line = re.compile(r"\]\s+(\S+)\s+- \[.*?type =\s+(\w+),.*?(?:-> .*\((\w+)\))?\s*$")
    mixes = [m for m in MIXES if m not in ("F32", "F16", "BF16")]
    assert set(LOW_BIT) <= set(mixes)
    for mix in mixes:
        r = subprocess.run([exe, "--dry-run", "--imatrix", str(imatrix), str(f16), str(tmp_path / "q.gguf"), mix, "1"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (mix, r.stderr[-2000:])
        theirs = {m.group(1): (m.group(3) or m.group(2)).upper()
                  for m in map(line.search, (r.stdout + r.stderr).splitlines()) if m}
        ours = mix_qtypes([(t.name, t.shape) for t in plans], mix, p.n_layer, p.n_head[0] // p.n_head_kv)
        assert {t.name: q.name for t, q in zip(plans, ours)} == theirs, mix


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_runs_every_low_bit_file(synth_model, arch: str) -> None:
    """llama.cpp loads and runs every low-bit file ``repack synth`` writes (the block layouts and
    types it reads back): a prompt and a few decode steps of ``llama-bench``. Needs a llama.cpp
    ``llama-bench`` binary in SPARKPACK_LLAMA_BENCH."""
    import os

    exe = os.environ.get("SPARKPACK_LLAMA_BENCH")
    if not exe:
        pytest.skip("SPARKPACK_LLAMA_BENCH is not set (path to a llama.cpp llama-bench binary); "
                    "test_dequant checks the blocks against gguf-py")
    for mix in LOW_BIT:
        path = synth_model(arch, quant=mix)
        r = subprocess.run([exe, "-m", str(path), "-p", "16", "-n", "4", "-r", "1", "-t", "2", "-o", "json"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (mix, r.stderr[-2000:])
        rows = json.loads(r.stdout)
        assert [(row["n_prompt"], row["n_gen"]) for row in rows] == [(16, 0), (0, 4)], mix
        assert all(row["avg_ts"] > 0 for row in rows), mix
