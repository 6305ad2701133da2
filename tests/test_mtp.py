"""The multi-token-prediction ("nextn") head of qwen35moe files: what ``repack synth --mtp`` writes
against llama.cpp's names and keys, the spec keeping the head apart from the trunk (inspect, split
and join, the --vram plan, loading), and the head's forward against a float64 reference built here
from llama.cpp's ``graph_mtp`` / vLLM's ``Qwen3NextMultiTokenPredictor`` on gguf-py's dequantized
weights, with its own KV cache over several calls."""
from __future__ import annotations

import json
import re
import tarfile
import types
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from sparkpack.formats.archs import model_spec
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.experts import expert_tensor_names
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.memory import MemoryTarget, dense_bytes, head_bytes
from sparkpack.formats.placement import Budget, plan_residency
from sparkpack.formats.sparkpack import Pack
from sparkpack.repack.synth import write_synthetic
from sparkpack.repack.synth.presets import get_preset
from sparkpack.runtime.models import StoreOptions, load_model
from tests.gguf_edit import rewrite
from tests.paths import sdist_candidates

TINY = get_preset("qwen35moe", "tiny")
HEAD = TINY.n_layer  # the head's block comes after the trunk's


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory) -> callable:
    made: dict[tuple[str, bool], Path] = {}

    def make(quant: str = "Q8_0", mtp: bool = True) -> Path:
        if (quant, mtp) not in made:
            path = tmp_path_factory.mktemp("mtp") / f"m-{quant}-{mtp}.gguf"
            made[quant, mtp] = write_synthetic(path, "qwen35moe", "tiny", quant, seed=3, mtp=mtp)
        return made[quant, mtp]

    return make


# --- what synth writes, against llama.cpp ------------------------------------------------------


@lru_cache(maxsize=1)
def llama_cpp_sources() -> dict[str, str]:
    """gguf-py's constants and the qwen35moe model file of llama.cpp's source package (the one the
    chat-template tests read), at test time."""
    want = ("gguf-py/gguf/constants.py", "src/models/qwen35moe.cpp")
    for source in sdist_candidates():
        got: dict[str, str] = {}
        if source.is_dir():
            for suffix in want:
                got.update({suffix: p.read_text() for p in source.rglob(suffix.rsplit("/", 1)[-1])
                            if p.as_posix().endswith(suffix)})
        elif source.is_file():
            with tarfile.open(source) as tar:
                for member in tar:
                    for suffix in want:
                        if member.name.endswith("vendor/llama.cpp/" + suffix):
                            got[suffix] = tar.extractfile(member).read().decode()
        if len(got) == len(want):
            return got
    return {}


@pytest.mark.slow
def test_synth_head_has_llama_cpp_names_key_and_loader_shapes(mtp_file) -> None:
    src = llama_cpp_sources()
    if not src:
        pytest.skip("llama-cpp-python's source package is not on this machine (README's test command)")
    consts = types.ModuleType("llama_cpp_gguf_constants")
    exec(compile(src["gguf-py/gguf/constants.py"], "constants.py", "exec"), consts.__dict__)
    arch = consts.MODEL_ARCH.QWEN35MOE
    names = {consts.TENSOR_NAMES[t].format(bid=HEAD) for t in consts.MODEL_TENSORS[arch]}
    with GGUFModel(mtp_file()) as m:
        head = sorted(n for n in m.tensors if n.startswith(f"blk.{HEAD}."))
        assert m.get(consts.Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch="qwen35moe")) == 1
        assert m.get("qwen35moe.block_count") == TINY.n_layer + 1
        assert all(n.rsplit(".", 1)[0] in names for n in head), head
        # every tensor llama.cpp's load_block_mtp requires (flag 0), with its ne
        e, d, ff, sh = TINY.n_embd, TINY.head_dim, TINY.n_ff_exp, TINY.n_ff_shexp
        h, kv, x = TINY.n_head[-1], TINY.n_head_kv, TINY.n_expert
        required = {"attn_norm": (e,), "post_attention_norm": (e,), "attn_q": (e, 2 * d * h), "attn_k": (e, d * kv),
                    "attn_v": (e, d * kv), "attn_output": (d * h, e), "attn_q_norm": (d,), "attn_k_norm": (d,),
                    "ffn_gate_inp": (e, x), "ffn_down_exps": (ff, e, x), "ffn_gate_exps": (e, ff, x),
                    "ffn_up_exps": (e, ff, x), "ffn_gate_inp_shexp": (e,), "ffn_gate_shexp": (e, sh),
                    "ffn_up_shexp": (e, sh), "ffn_down_shexp": (sh, e), "nextn.eh_proj": (2 * e, e),
                    "nextn.enorm": (e,), "nextn.hnorm": (e,)}
        for short, ne in required.items():
            assert m.tensors[f"blk.{HEAD}.{short}.weight"].shape == ne, short
        # and the loader names the same ones (read, not copied: its create_tensor calls)
        loader = src["src/models/qwen35moe.cpp"]
        block = loader[loader.index("load_block_mtp"):loader.index("for (int i = 0; i < n_layer; ++i)")]
        for enum in ("NEXTN_EH_PROJ", "NEXTN_ENORM", "NEXTN_HNORM", "ATTN_NORM", "ATTN_POST_NORM", "FFN_GATE_INP"):
            assert f"LLM_TENSOR_{enum}," in block and getattr(consts.MODEL_TENSOR, enum) in consts.MODEL_TENSORS[arch]
        assert "shared_head_norm" in re.sub(r"\s+", " ", block)


def test_synth_head_types_follow_llama_quantize(mtp_file) -> None:
    """llama-quantize counts the head's block with the trunk's (``n_layer_all``): at Q4_K_M the
    head's attn_v and expert down projections are in the last eighth and get Q6_K."""
    with GGUFModel(mtp_file("Q4_K_M")) as m:
        t = {n: T(m.tensors[n].qtype) for n in m.tensors if n.startswith(f"blk.{HEAD}.")}
    p = f"blk.{HEAD}."
    assert t[p + "attn_v.weight"] == T.Q6_K and t[p + "ffn_down_exps.weight"] == T.Q6_K
    assert t[p + "nextn.eh_proj.weight"] == T.Q4_K and t[p + "attn_q.weight"] == T.Q4_K
    assert {t[p + n] for n in ("nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
                               "ffn_gate_inp.weight", "attn_norm.weight")} == {T.F32}


def test_spec_keeps_the_head_apart(mtp_file) -> None:
    with GGUFModel(mtp_file()) as m, GGUFModel(mtp_file(mtp=False)) as plain:
        spec, bare = model_spec(m), model_spec(plain)
        assert spec.n_layer == bare.n_layer == TINY.n_layer
        assert spec.moe_layers == bare.moe_layers and spec.expert_tensors == bare.expert_tensors
        assert bare.nextn is None and bare.head_tensor_names() == frozenset()
        assert spec.nextn is not None and spec.nextn.layers == (HEAD,)
        assert spec.head_tensor_names() == {n for n in m.tensors if n.startswith(f"blk.{HEAD}.")}
        assert not spec.head_tensor_names() & expert_tensor_names(spec)
        # the trunk's tensors are the same in both files
        assert set(m.tensors) - spec.head_tensor_names() == set(plain.tensors)


def test_head_without_its_tensors_is_one_error(mtp_file, tmp_path) -> None:
    """A file that names a head (the key, the block count) but lacks its blocks' tensors: one
    error naming the first missing one, as for the trunk's."""
    e, ff, x = TINY.n_embd, TINY.n_ff_exp, TINY.n_expert
    experts = {f"blk.{HEAD}.ffn_{r}_exps.weight": np.zeros((x, ff, e) if r != "down" else (x, e, ff), np.float32)
               for r in ("gate", "up", "down")}
    bad = rewrite(mtp_file(mtp=False), tmp_path / "bad.gguf",
                  {"qwen35moe.nextn_predict_layers": (1, gguf.GGUFValueType.UINT32),
                   "qwen35moe.block_count": TINY.n_layer + 1}, add_tensors=experts)
    with GGUFModel(bad) as m, pytest.raises(SparkpackError, match=f"missing tensor blk.{HEAD}."):
        model_spec(m)


# --- inspect, split/join, the plan, loading ----------------------------------------------------


def test_inspect_shows_the_head(mtp_file, cli) -> None:
    code, out, _ = cli("inspect", mtp_file())
    assert code == 0 and "MTP head" in out and f"blk.{HEAD}" in out
    code, plain, _ = cli("inspect", mtp_file(mtp=False))
    assert code == 0 and "MTP head        none" in plain
    r = json.loads(cli("inspect", mtp_file(), "--json")[1])
    bare = json.loads(cli("inspect", mtp_file(mtp=False), "--json")[1])
    with GGUFModel(mtp_file()) as m:
        assert r["mtp_bytes"] == sum(m.tensors[n].nbytes for n in model_spec(m).head_tensor_names())
    assert r["mtp_layers"] == [HEAD] and bare["mtp_layers"] == [] and bare["mtp_bytes"] == 0
    # the trunk's figures do not count the head (a run that does not draft never loads it)
    for key in ("layers", "expert_bytes", "other_bytes", "vram_all_gpu_bytes"):
        assert r[key] == bare[key], key


def test_calibrate_split_join_keep_the_head_out_and_byte_exact(mtp_file, tmp_path, cli) -> None:  # noqa: F811
    """Calibration replays the trunk only (its profile has the trunk's layers), the pack places the
    trunk's experts only (the head's blocks travel with the dense part, in the hot shard), and
    join gives the file back byte for byte."""
    src = tmp_path / "m.gguf"
    src.write_bytes(mtp_file("Q4_K_M").read_bytes())
    corpus = Path(__file__).resolve().parents[1] / "corpora" / "openai_chat.jsonl"
    code, _, err = cli("calibrate", src, "--corpus", corpus)
    assert code == 0, err
    prof = json.loads(cli("inspect", tmp_path / "m.profile.json", "--json")[1])
    assert prof["layers"] == TINY.n_layer and prof["moe_layers"] == TINY.n_layer
    code, _, err = cli("split", src, "-o", tmp_path / "m.sparkpack", "--hot-fraction", "0.5")
    assert code == 0, err
    pack = Pack.open(tmp_path / "m.sparkpack")
    assert pack.hot.shape == (TINY.n_layer, TINY.n_expert)  # placement: the trunk's experts only
    assert sorted(pack.parts) == list(range(TINY.n_layer))
    code, _, err = cli("join", tmp_path / "m.sparkpack", "-o", tmp_path / "back.gguf")
    assert code == 0, err
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()
    code, _, err = cli("verify", tmp_path / "m.sparkpack")
    assert code == 0, err


def test_vram_plan_counts_the_head_only_when_loaded(mtp_file) -> None:
    with GGUFModel(mtp_file("Q4_K_M")) as m:
        spec = model_spec(m)
        head = spec.head_tensor_names()
        target = MemoryTarget.gpu(spec, 512)
        budget = Budget(vram=1536 * 1024**2)
        off = plan_residency(spec, m.tensors, budget, target)
        trunk = {n: t for n, t in m.tensors.items() if n not in head}
        assert off.head_bytes == 0 and off.dense_bytes == dense_bytes(trunk, expert_tensor_names(spec), target)
        on_target = MemoryTarget(**{**target.__dict__, "mtp": True})
        on = plan_residency(spec, m.tensors, budget, on_target)
        experts = spec.nextn.expert_names()
        held = dense_bytes({n: m.tensors[n] for n in head - experts}, set(), on_target)  # as the trunk's
        kv = 2 * TINY.n_head_kv * TINY.head_dim * 512 * 2  # one full-attention layer at the context, bf16
        assert on.head_bytes == head_bytes(spec, m.tensors, on_target) \
            == held + sum(m.tensors[n].nbytes for n in experts) + kv  # experts as their Q4_K/Q6_K bytes
        assert on.dense_bytes == off.dense_bytes and on.expert_budget == off.expert_budget - on.head_bytes
        assert head_bytes(spec, m.tensors, target) == 0
        tight = Budget(vram=off.vram - off.expert_budget + on.head_bytes // 2)
        plan_residency(spec, m.tensors, tight, target)  # fits without the head
        with pytest.raises(SparkpackError, match="the MTP head"):
            plan_residency(spec, m.tensors, tight, on_target)


def _loaded(model) -> set[str]:
    return {n for key in [*model.w.expanded, *model.w.as_stored] for n in key.split("+")}


def test_runs_load_the_head_only_when_asked(mtp_file) -> None:
    path = mtp_file()
    plain = load_model(path)
    plain.forward([1, 2, 3])
    head = plain.spec.head_tensor_names()
    assert not _loaded(plain) & head
    stored = load_model(path, store=StoreOptions(hot_fraction=0.5))  # preloads every dense tensor
    assert not _loaded(stored) & head and _loaded(stored)
    drafting = load_model(path, store=StoreOptions(hot_fraction=0.5, mtp=True))
    assert head - drafting.spec.nextn.expert_names() <= _loaded(drafting)
    with pytest.raises(SparkpackError, match="no multi-token-prediction head"):
        load_model(mtp_file(mtp=False)).load_mtp()


# --- the head's forward against a float64 reference --------------------------------------------


def reference_weights(path: Path) -> dict[str, np.ndarray]:
    """Every tensor in float64, dequantized by gguf-py (numpy order: GGUF ne reversed)."""
    return {t.name: dequantize(t.data, t.tensor_type).astype(np.float64).reshape(tuple(reversed(t.shape.tolist())))
            for t in GGUFReader(path).tensors}


def reference_head(W: dict[str, np.ndarray], ids: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The MTP block over all rows at once (causal attention at positions 0..T-1), written from
    llama.cpp's graph_mtp: [enorm(embed) | hnorm(h)] -> eh_proj -> gated attention -> MoE with a
    sigmoid-gated shared expert -> shared_head_norm -> output. Returns (logits, normed hidden)."""
    p, eps = f"blk.{HEAD}.", TINY.rms_eps
    d, H, Hkv, k = TINY.head_dim, TINY.n_head[-1], TINY.n_head_kv, TINY.n_expert_used

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def silu(x):
        return x / (1 + np.exp(-x))

    def sigmoid(x):
        return 1 / (1 + np.exp(-x))

    T_ = len(ids)
    u = np.concatenate([rms(W["token_embd.weight"][ids], W[p + "nextn.enorm.weight"]),
                        rms(hidden, W[p + "nextn.hnorm.weight"])], -1) @ W[p + "nextn.eh_proj.weight"].T
    a = rms(u, W[p + "attn_norm.weight"])
    qg = (a @ W[p + "attn_q.weight"].T).reshape(T_, H, 2 * d)
    q, gate = rms(qg[..., :d], W[p + "attn_q_norm.weight"]), qg[..., d:]
    kk = rms((a @ W[p + "attn_k.weight"].T).reshape(T_, Hkv, d), W[p + "attn_k_norm.weight"])
    v = (a @ W[p + "attn_v.weight"].T).reshape(T_, Hkv, d)
    rd = TINY.rope_dim  # NEOX rotation of the first rope_dim channels (text: imrope's axes agree)
    ang = np.arange(T_)[:, None] * TINY.rope_base ** (-np.arange(0, rd, 2) / rd)[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):
        x1, x2 = x[..., :rd // 2], x[..., rd // 2:rd]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:]], -1)

    q, kk = rope(q), rope(kk)
    o = np.empty((T_, H, d))
    for hh in range(H):
        g = hh // (H // Hkv)
        s = q[:, hh] @ kk[:, g].T / np.sqrt(d) + np.triu(np.full((T_, T_), -np.inf), 1)
        pr = np.exp(s - s.max(-1, keepdims=True))
        o[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, g]
    u = u + (o * sigmoid(gate)).reshape(T_, -1) @ W[p + "attn_output.weight"].T
    f = rms(u, W[p + "post_attention_norm.weight"])
    logits = f @ W[p + "ffn_gate_inp.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    moe = np.zeros_like(u)
    for t in range(T_):
        top = np.argsort(-probs[t])[:k]
        wts = probs[t, top] / probs[t, top].sum()
        for e, wt in zip(top, wts):
            hid = silu(f[t] @ W[p + "ffn_gate_exps.weight"][e].T) * (f[t] @ W[p + "ffn_up_exps.weight"][e].T)
            moe[t] += wt * (hid @ W[p + "ffn_down_exps.weight"][e].T)
    shared = (silu(f @ W[p + "ffn_gate_shexp.weight"].T) * (f @ W[p + "ffn_up_shexp.weight"].T)) \
        @ W[p + "ffn_down_shexp.weight"].T
    u = u + moe + shared * sigmoid(f @ W[p + "ffn_gate_inp_shexp.weight"])[:, None]
    out = rms(u, W[p + "nextn.shared_head_norm.weight"])
    return out @ W["output.weight"].T, out


def rel(got: torch.Tensor, ref: np.ndarray) -> float:
    """Worst per-row relative L2 error."""
    g, r = got.double().cpu().numpy(), ref
    return float((np.linalg.norm(g - r, axis=-1) / np.linalg.norm(r, axis=-1)).max())


# float64: the runtime forms rotary angles in float32 as transformers does (runtime.layers.Rope)
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-4), (torch.float64, 1e-8)])
def test_head_forward_matches_the_reference_with_its_cache(mtp_file, dtype, bound) -> None:
    """The head drafts from the trunk's normed hidden states: a prompt's rows in one call, then one
    row at a time through its KV cache, then a rejected draft rolled back by its position and
    recomputed. Every row against the reference over all rows at once."""
    path = mtp_file()
    W = reference_weights(path)
    model = load_model(path, dtype=dtype)
    ids = torch.randint(0, TINY.n_vocab, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    logits, hidden = model.forward_hidden(ids)
    assert torch.equal(logits, model.forward(ids))  # forward_hidden's logits are forward's, from its rows
    assert torch.equal(model.w.linear(hidden, "output.weight"), logits)
    head = model.load_mtp()
    pairs, h = ids[1:], hidden[:-1]  # x_{t+1} with h_t
    ref_logits, ref_hidden = reference_head(W, np.asarray(pairs), h.double().numpy())
    cache = head.new_cache(capacity=4)  # grows as rows come
    assert not cache.layers[HEAD].fits(40, 1)
    model.reserve_kv(cache, 40, 1)  # as before a captured step (the head's block is past the trunk)
    assert cache.layers[HEAD].fits(40, 1)
    outs = [head.forward(pairs[:5], h[:5], cache)]
    outs += [head.forward(pairs[i:i + 1], h[i:i + 1], cache) for i in range(5, 7)]
    wrong = head.forward([(pairs[7] + 1) % TINY.n_vocab], h[7:8], cache)  # a draft that gets rejected
    cache.pos -= 1
    outs += [head.forward(pairs[i:i + 1], h[i:i + 1], cache) for i in range(7, 9)]
    got_logits, got_hidden = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
    assert cache.pos == len(pairs)
    assert rel(got_logits, ref_logits) < bound and rel(got_hidden, ref_hidden) < bound
    assert not torch.equal(wrong[0], outs[3][0])
    last = head.forward(pairs[:5], h[:5], head.new_cache(), last_only=True)
    # (a one-row product need not give a five-row one's bits: compared as values)
    assert last[0].shape[0] == 1 and torch.equal(last[1], outs[0][1]) and rel(last[0], ref_logits[4:5]) < bound
    # greedy drafts: each step the head's own output fed back, the cache left where it was
    drafts = head.draft(pairs[-1], hidden[-1:], cache, 3)
    assert cache.pos == len(pairs)
    token, row, want = pairs[-1], hidden[-1:], []
    for _ in range(3):
        lg, row = head.forward([token], row, cache)
        token = int(lg[-1].argmax())
        want.append(token)
    assert drafts == want


@pytest.mark.parametrize("quant, bound", [("Q8_0", 1e-5), ("Q4_K_M", 2e-2)])
@pytest.mark.slow
def test_head_experts_from_device_pools_match_the_expanded_ones(mtp_file, quant, bound) -> None:
    """On a GPU the head's experts stay GGUF bytes in one pool per role, read by the fused MoE
    kernels through an identity slot table (interpreted here without one); the plain path expands
    each expert. Q4_K/Q6_K take int8 activations in the kernels, hence the looser bound."""
    from sparkpack.runtime.models.qwen35moe_mtp import HeadExperts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with GGUFModel(mtp_file(quant)) as m:
        roles = model_spec(m).nextn.expert_tensors[HEAD]
        g = torch.Generator().manual_seed(2)
        x = torch.randn(3, TINY.n_embd, generator=g)
        probs = torch.softmax(torch.randn(3, TINY.n_expert, generator=g), -1)
        wts, ids = probs.topk(TINY.n_expert_used, -1)
        plain = HeadExperts(m, roles, TINY.n_expert, torch.device("cpu"), torch.float32, pools=False)
        fused = HeadExperts(m, roles, TINY.n_expert, torch.device(device), torch.float32, pools=True)
        ref = plain.moe(HEAD, x, wts, ids)
        got = fused.moe(HEAD, x.to(device), wts.to(device), ids.to(device)).sum(1).cpu()
    assert float((got - ref).norm() / ref.norm()) < bound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the head on a GPU: its kernels and held bytes")
def test_head_forward_on_the_gpu_matches_the_reference(mtp_file) -> None:
    """The GPU path (dense weights held as bytes, experts from the device pools, the attention
    kernels) through prefill rows and single decode rows, float32 on a Q8_0 file."""
    path = mtp_file()
    W = reference_weights(path)
    model = load_model(path, device="cuda", dtype=torch.float32)
    ids = torch.randint(0, TINY.n_vocab, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    _, hidden = model.forward_hidden(ids)
    head = model.load_mtp()
    assert head.experts.pools is not None
    pairs, h = ids[1:], hidden[:-1]
    ref_logits, _ = reference_head(W, np.asarray(pairs), h.double().cpu().numpy())
    cache = head.new_cache()
    outs = [head.forward(pairs[:5], h[:5], cache)] + [head.forward(pairs[i:i + 1], h[i:i + 1], cache)
                                                      for i in range(5, 9)]
    assert rel(torch.cat([o[0] for o in outs]), ref_logits) < 1e-3


def test_llama_cpp_export_leaves_the_head_out(mtp_file) -> None:
    """``repack export --llama-cpp`` plans llama-cli/llama-server runs, which load an MTP head only
    with ``--spec-type draft-mtp`` (llama.cpp's ``load_mtp``): its bytes are not on their GPU."""
    from sparkpack.repack.llama_cpp_args import plan_llama_cpp

    with GGUFModel(mtp_file("Q4_K_M")) as m:
        spec = model_spec(m)
        sizes = {n: t.nbytes for n, t in m.tensors.items()}
        trunk = {n: b for n, b in sizes.items() if n not in spec.head_tensor_names()}
        with_head = plan_llama_cpp(sizes, spec, 2 * 1024**3, 4096)
        without = plan_llama_cpp(trunk, spec, 2 * 1024**3, 4096)
    assert with_head.gpu_weights == without.gpu_weights and with_head.expert_layer_bytes == without.expert_layer_bytes
