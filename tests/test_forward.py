"""The runtime forward pass against transformers, the outside referee.

Tiny random models (tests/hf_tiny.py) are converted by repack.convert_hf; our logits on the GGUF
must match transformers' on the original weights at every position, greedy continuations must be
identical, and cached prefill+decode must equal one full forward. On a q8_0 file there is no
transformers twin, so the float32 forward is compared with a float64 forward of the same
dequantized weights.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sparkpack.runtime.experts import GGUFExperts, PlainProvider
from sparkpack.runtime.generate import generate
from sparkpack.runtime.layers import Normed, Rope, Rows, rope_inv_freq, yarn_rope
from sparkpack.runtime.models import load_model

ARCHS = ("qwen3moe", "laguna", "qwen35moe")
# CI runs this file on the CPU; on the GPU machine the same file runs with SPARKPACK_TEST_DEVICE=cuda.
DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")


def load(path, **kwargs):
    return load_model(path, device=DEVICE, **kwargs)
N_TOKENS = 24  # longer than laguna's tiny sliding window (8) so the window mask matters


@pytest.fixture(scope="module")
def hf_ref(tiny_hf_gguf):
    """``get(arch) -> transformers model`` loaded once per module."""
    from tests.hf_tiny import load_tiny_hf

    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = load_tiny_hf(tiny_hf_gguf(arch)[0])
        return cache[arch]

    return get


def token_ids(vocab: int, n: int = N_TOKENS, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst per-position relative L2 error."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tiny_hf_gguf, hf_ref):
    hf = hf_ref(arch)
    model = load(tiny_hf_gguf(arch)[1])
    ids = token_ids(hf.config.vocab_size)
    out, ref = model.forward(ids), hf_logits(hf, ids)
    assert out.shape == ref.shape
    assert row_rel_err(out, ref) < 1e-4
    assert torch.equal(out.argmax(-1).cpu(), ref.argmax(-1).cpu())


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_matches_transformers(arch, tiny_hf_gguf, hf_ref):
    hf = hf_ref(arch)
    model = load(tiny_hf_gguf(arch)[1])
    prompt = token_ids(hf.config.vocab_size, 6, seed=2)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    ours = list(generate(model, None, prompt, None, 32, stop_ids=[]))
    assert ours == ref


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_prefill_then_decode_equals_full_forward(arch, outtype, tiny_hf_gguf):
    """In float64, so that matmul blocking round-off (1e-5 in float32) cannot hide a cache bug."""
    model = load(tiny_hf_gguf(arch, outtype)[1], dtype=torch.float64)
    ids = token_ids(model.spec.n_vocab)
    full = model.forward(ids)
    cache = model.new_cache()
    parts = [model.forward(ids[:10], cache), model.forward(ids[10:15], cache)]  # two prefill chunks
    parts += [model.forward(ids[i:i + 1], cache) for i in range(15, len(ids))]  # then decode
    assert cache.pos == len(ids)
    assert row_rel_err(torch.cat(parts), full) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_decode_kernels_match_the_torch_path(arch, tiny_hf_gguf):
    """Prefills and decode steps through the fused DeltaNet and attention kernels (``model.kernels``,
    the GPU default; interpreted in CI: q/k norms, rope, KV append, GQA with Laguna's sliding
    windows and softplus gate, Qwen3.5's sigmoid gate) against the torch form, float32: prefill,
    then every decode step's logits. (RMSNorm, the router and the MoE block's elementwise steps
    use their kernels on any GPU tensor; tests/test_kernels.py and test_fused_steps.py cover them.)"""
    path = tiny_hf_gguf(arch)[1]
    ids = token_ids(load(path).spec.n_vocab, 90)

    def steps(kernels: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        model = load(path, dtype=dtype)
        model.kernels = kernels
        cache = model.new_cache()
        # prefills of 8 tokens (one padded chunk), 2 (fewer than the conv window: the window is
        # partly the old one) and 68 (two chunks), each through the prefill kernels (conv, norms
        # and gates in one launch, the state carried in one), then decode steps
        out = [model.forward(ids[:8], cache), model.forward(ids[8:10], cache), model.forward(ids[10:78], cache)]
        out += [model.forward(ids[i:i + 1], cache) for i in range(78, len(ids))]
        return torch.cat(out)

    # the fused prefill chunks even 8 tokens, so the two float32 forms differ by round-off in
    # their own ways: both are held to the float64 torch form
    ref = steps(False, torch.float64)
    fused, plain = row_rel_err(steps(True), ref), row_rel_err(steps(False), ref)
    assert fused < 5e-5 and plain < 5e-5, (fused, plain)  # float32 round-off over 90 positions


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_attention_reads_and_writes_a_q8_0_cache(arch, synth_model):
    """``--kv-type q8_0`` through the attention kernels (codes written and read in place) against
    the torch form (which quantizes the same rows and expands the whole buffer): the same logits
    up to float32 round-off, and not those of a float cache (the codes are really used)."""
    path = synth_model(arch)
    ids = token_ids(load(path).spec.n_vocab, 20)

    def steps(kernels: bool, kv_type: str) -> torch.Tensor:
        model = load(path)
        model.kernels = kernels
        cache = model.new_cache(kv_type=kv_type)
        return torch.cat([model.forward(ids[:6], cache)] + [model.forward(ids[i:i + 1], cache) for i in range(6, 20)])

    fused, plain = steps(True, "q8_0"), steps(False, "q8_0")
    assert row_rel_err(fused, plain) < 1e-4 and row_rel_err(plain, steps(False, "auto")) > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_each_block_epilogue_names_the_norm_that_opens_the_next(arch, synth_model):
    """One-token GPU steps compute the next block's input norm in the MoE epilogue's launch
    (``MoEBlock.next_norm``, ``layers.ffn_residual``): every layer names the next layer's
    ``attn_norm`` (the last, the output norm), and ``norm`` takes a norm so computed instead of
    computing it again, for that weight only. (The kernel itself: tests/test_fused_steps.py.)"""
    model = load(synth_model(arch))
    dev = model.w("output_norm.weight").device
    one, many = torch.zeros(1, model.spec.n_embd, device=dev), torch.zeros(3, model.spec.n_embd, device=dev)
    block = model.moe_block
    assert block.next_norm(0, one, kernels=False) is None
    assert block.next_norm(0, many, kernels=True) is None  # prefill: the next block norms its rows itself
    n = model.spec.n_layer
    for il in range(n):
        w, eps = block.next_norm(il, one, kernels=True)
        assert w is model.w(f"blk.{il + 1}.attn_norm.weight" if il + 1 < n else "output_norm.weight")
        assert eps == model.eps
    x, done = torch.randn(1, model.spec.n_embd, device=dev), torch.randn(1, model.spec.n_embd, device=dev)
    pre = Normed(model.w("blk.1.attn_norm.weight"), Rows(done))
    assert model.norm(x, "blk.1.attn_norm.weight", pre).x is done
    assert model.norm(x, "blk.2.attn_norm.weight", pre).x is not done


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_float32_matches_float64_reference(arch, tiny_hf_gguf):
    path = tiny_hf_gguf(arch, "q8_0")[1]
    m32, m64 = load(path), load(path, dtype=torch.float64)
    ids = token_ids(m32.spec.n_vocab)
    out, ref = m32.forward(ids), m64.forward(ids)
    assert ref.dtype == torch.float64
    assert row_rel_err(out, ref) < 1e-4
    prompt = ids[:6]
    assert list(generate(m32, None, prompt, None, 32, stop_ids=[])) == \
        list(generate(m64, None, prompt, None, 32, stop_ids=[]))
    # the q8_0 weights really are quantized: near the f32 model at the first position, not equal.
    # (Later positions drift further: routing flips at near-ties and the recurrent state amplify
    # the quantization error of these tiny random models; llama.cpp's own q8_0 file agrees.)
    f32 = load(tiny_hf_gguf(arch)[1]).forward(ids)
    per_row = (out - f32).norm(dim=-1) / f32.norm(dim=-1)
    assert 0 < float(per_row[0]) < 0.1


class CountingExperts(PlainProvider):
    """An expert provider that records every call, proving MoE layers go only through it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def forward(self, layer, expert, x):
        self.calls.append((layer, expert, x.shape[0]))
        return self.inner.forward(layer, expert, x)


def test_experts_are_reached_only_through_the_provider(tiny_hf_gguf):
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.runtime.models import MODELS

    path = tiny_hf_gguf("qwen3moe")[1]
    gguf = GGUFModel(path)
    spec = model_spec(gguf)
    counting = CountingExperts(GGUFExperts(gguf, spec, max_bytes=1))  # keeps one expert: evicts on every miss
    model = MODELS["qwen3moe"](gguf, spec, experts=counting)
    ids = token_ids(spec.n_vocab, 8)
    assert row_rel_err(model.forward(ids), load(path).forward(ids)) < 1e-6
    rows_per_layer = {}
    for layer, _, n in counting.calls:
        rows_per_layer[layer] = rows_per_layer.get(layer, 0) + n
    assert rows_per_layer == {il: len(ids) * spec.n_expert_used for il in spec.moe_layers}


def test_imrope_matches_transformers_sections(tiny_hf_gguf, hf_ref):
    """Qwen3.5's interleaved multi-section rope with distinct t/h/w positions (text uses equal
    ones, where it reduces to plain rope)."""
    hf = hf_ref("qwen35moe")
    emb = hf.model.rotary_emb
    sections = tuple(emb.mrope_section)
    dim = emb.inv_freq.numel() * 2
    rope = Rope(dim, emb.inv_freq.clone(), 1.0, sections)
    pos = torch.stack([torch.arange(7), torch.arange(7) * 3 + 1, torch.arange(7) * 5 + 2])
    cos_ref, sin_ref = emb(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    cos, sin = rope.cos_sin(pos, torch.float32)
    assert torch.allclose(cos, cos_ref[0], atol=1e-6) and torch.allclose(sin, sin_ref[0], atol=1e-6)
    plain = Rope(dim, emb.inv_freq.clone())
    assert torch.equal(rope.cos_sin(pos[0].expand(3, -1), torch.float32)[0], plain.cos_sin(pos[0], torch.float32)[0])


def test_yarn_matches_transformers():
    from transformers import LagunaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5, "factor": 8.0,
              "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
    cfg = LagunaConfig(head_dim=128, layer_types=["full_attention"], num_hidden_layers=1,
                       rope_parameters={"full_attention": params, "sliding_attention": None})
    inv_ref, scale_ref = ROPE_INIT_FUNCTIONS["yarn"](cfg, None, layer_type="full_attention")
    rope = yarn_rope(500000.0, 64, 8.0, 4096)
    assert torch.allclose(rope.inv_freq, inv_ref, rtol=1e-6) and rope.scale == pytest.approx(scale_ref)
    assert not torch.allclose(rope.inv_freq, rope_inv_freq(500000.0, 64))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_spark_run_logits_out_matches_transformers(arch, tiny_hf_gguf, hf_ref, tmp_path):
    hf = hf_ref(arch)
    ids = token_ids(hf.config.vocab_size, 12, seed=3)
    out = tmp_path / "logits.npy"
    r = subprocess.run([sys.executable, "-m", "sparkpack.runtime.cli", str(tiny_hf_gguf(arch)[1]),
                        "--prompt-ids", ",".join(map(str, ids)), "--logits-out", str(out), "--device", DEVICE, "--dtype", "float32"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == (len(ids), hf.config.vocab_size)
    assert row_rel_err(torch.from_numpy(logits), hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_k_quant_file(arch, synth_model):
    """A Q4_K_M-style file (Q4_K/Q6_K plus fallbacks, real tensor layout, synthetic weights): the
    float32 forward matches float64 on the same dequantized weights, and the cache is exact."""
    path = synth_model(arch, "Q4_K_M")
    m32, m64 = load(path), load(path, dtype=torch.float64)
    ids = token_ids(m32.spec.n_vocab, 12)
    ref = m64.forward(ids)
    assert torch.isfinite(ref).all()
    assert row_rel_err(m32.forward(ids), ref) < 1e-4
    cache = m64.new_cache()
    parts = [m64.forward(ids[:7], cache)] + [m64.forward([t], cache) for t in ids[7:]]
    assert row_rel_err(torch.cat(parts), ref) < 1e-10


def test_laguna_yarn_full_layers_match_transformers(tmp_path):
    """Laguna's full-attention layers use YaRN in the real model; the converted file carries the
    scaling keys and our rope must reproduce transformers' (sliding layers stay plain)."""
    from sparkpack.repack.convert_hf import convert
    from tests.hf_tiny import load_tiny_hf, make_tiny_hf

    rope = {"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                               "factor": 4.0, "original_max_position_embeddings": 128},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
    hf_dir = make_tiny_hf("laguna", tmp_path / "hf", seed=3, rope_parameters=rope)
    model = load(convert(hf_dir, tmp_path / "yarn.gguf", "f32"))
    assert model.rope_full.scale > 1.0 and model.rope_swa.scale == 1.0
    hf = load_tiny_hf(hf_dir)
    ids = token_ids(hf.config.vocab_size, 40)
    assert row_rel_err(model.forward(ids), hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("T", [150, 128, 40])
def test_chunked_delta_rule_equals_recurrent(T):
    """float64, a partial last chunk (or whole chunks, or less than one) and a non-zero start
    state (a prefill after earlier turns)."""
    from sparkpack.runtime.layers import l2_norm
    from sparkpack.runtime.models.qwen35moe import gated_delta_rule, gated_delta_rule_chunked

    g = torch.Generator().manual_seed(0)
    H, dk, dv = 4, 8, 6

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = l2_norm(randn(T, H, dk)), l2_norm(randn(T, H, dk)), randn(T, H, dv)
    decay = -3 * torch.rand(T, H, generator=g, dtype=torch.float64)
    beta = torch.rand(T, H, generator=g, dtype=torch.float64)
    state = randn(H, dk, dv)
    o_ref, s_ref = gated_delta_rule(q, k, v, decay, beta, state)
    o, s = gated_delta_rule_chunked(q, k, v, decay, beta, state, chunk=64)
    assert torch.allclose(o, o_ref, rtol=0, atol=1e-12) and torch.allclose(s, s_ref, rtol=0, atol=1e-12)


def test_qwen35moe_long_prefill_matches_transformers(tiny_hf_gguf, hf_ref):
    """A prompt longer than one DeltaNet chunk takes the chunked prefill path."""
    from sparkpack.runtime.models.qwen35moe import CHUNK

    hf = hf_ref("qwen35moe")
    model = load(tiny_hf_gguf("qwen35moe")[1])
    ids = token_ids(hf.config.vocab_size, 2 * CHUNK + 11)
    assert row_rel_err(model.forward(ids), hf_logits(hf, ids)) < 1e-4


def test_stacked_weights_are_row_bands_of_one_matrix(tiny_hf_gguf):
    """Projections of one input run as one GEMM over a stacked matrix; each tensor name then
    reads its rows of it (same values, no second copy), and mismatched widths are refused."""
    from sparkpack.formats.errors import FormatError

    model = load(tiny_hf_gguf("qwen35moe")[1])
    names = ("blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_beta.weight")
    before = [model.w(n).clone() for n in names]
    stacked = model.w.stacked(names)
    assert torch.equal(stacked, torch.cat(before)) and model.w.stacked(names) is stacked
    end = stacked.data_ptr() + stacked.numel() * stacked.element_size()
    for n, b in zip(names, before):
        assert torch.equal(model.w(n), b) and stacked.data_ptr() <= model.w(n).data_ptr() < end
    with pytest.raises(FormatError, match="cannot stack"):
        model.w.stacked(("blk.0.attn_qkv.weight", "blk.0.ssm_conv1d.weight"))  # widths n_embd and the conv kernel


@pytest.mark.parametrize("arch", ARCHS)
def test_projections_use_the_stacks_built_at_load(arch, tiny_hf_gguf):
    """With the expert store the dense weights load at once, stacked groups first; a forward
    then stacks nothing new (every ``project`` call is a declared group), so no tensor is ever
    held twice."""
    from sparkpack.runtime.models import StoreOptions

    model = load(tiny_hf_gguf(arch)[1], store=StoreOptions(hot_fraction=1.0))
    def held_stacks():  # expanded (CPU) or as GGUF bytes (GPU)
        return {k for k in (*model.w.expanded, *model.w.as_stored) if "+" in k}

    stacks = held_stacks()
    assert stacks == {"+".join(g) for g in model.stack_groups()} and stacks
    model.forward(token_ids(model.spec.n_vocab)[:6])
    assert held_stacks() == stacks


@pytest.mark.parametrize("window", [0, 5])
def test_attention_in_query_pieces_equals_one_pass(monkeypatch, window):
    """A long chunk over a long cache attends in query pieces (bounded score memory); every
    query row gets what one pass gives, with a cache already holding earlier positions."""
    from sparkpack.runtime import layers
    from sparkpack.runtime.cache import KVCache

    g = torch.Generator().manual_seed(3)
    T, H, Hkv, d, past = 13, 4, 2, 8, 6

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = randn(T, H, d), randn(T, Hkv, d), randn(T, Hkv, d)
    k0, v0 = randn(past, Hkv, d), randn(past, Hkv, d)
    outs = []
    for limit in (layers.ATTN_SCORES_MAX, H * 32 * 3):  # one pass; pieces of 3 queries (capacity 32)
        monkeypatch.setattr(layers, "ATTN_SCORES_MAX", limit)
        cache = KVCache(32)
        layers.attention(randn(past, H, d), k0, v0, cache, 0, window)  # earlier turn
        outs.append(layers.attention(q, k, v, cache, past, window))
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-12)
    assert cache.k.shape[1] == 32  # the pieces saw the whole buffer (rows = limit // (H * 32) = 3)
    # without a cache (a fresh full forward) the keys are the new tokens themselves
    fresh = []
    for limit in (layers.ATTN_SCORES_MAX, H * T * 2):
        monkeypatch.setattr(layers, "ATTN_SCORES_MAX", limit)
        fresh.append(layers.attention(q, k, v, None, 0, window))
    assert torch.allclose(fresh[0], fresh[1], rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_dense_matrices_held_as_gguf_bytes_give_the_expanded_forward(arch, synth_model):
    """The GPU keeps dense matrices as their GGUF bytes (``Weights(quantized=True)``): one token
    goes through the dense GEMV kernel, several through expanded bands and cuBLAS. Here (CPU, the
    kernels in Triton's interpreter) both must give the logits of the expanded weights, and no
    matrix may be held expanded as well. With float activations the one-token steps agree to fp32
    round-off; with int8 activations (the runtime's default, ``kernels/q8dot.py``) to the
    activations' rounding."""
    from sparkpack.runtime.quant_linear import QuantLinear
    from sparkpack.runtime.weights import Weights

    if os.environ.get("TRITON_INTERPRET") != "1":
        # CPU tensors need the interpreter; on a GPU every forward test above holds the bytes anyway
        pytest.skip("kernels on CPU tensors need Triton's interpreter")
    path = synth_model(arch, "Q4_K_M")
    ref, quant = load_model(path), load_model(path)
    quant.w = Weights(quant.gguf, "cpu", torch.float32, quantized=True)
    ids = token_ids(ref.spec.n_vocab, 8)
    caches = ref.new_cache(), quant.new_cache()
    for chunk, q8 in ((ids[:5], False), (ids[5:6], False), (ids[6:7], True), (ids[7:8], True)):
        quant.w.int8_activations = q8  # a prefill, two float steps, two int8 steps
        want, got = (m.forward(chunk, c) for m, c in zip((ref, quant), caches))
        if q8:
            err = float((got - want).norm() / want.norm())
            assert 1e-6 < err < 3e-2, err  # rounded, and by no more than the activations' rounding
        else:
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    held = quant.w.as_stored
    assert held and all(isinstance(m, QuantLinear) for m in held.values())
    assert not any(n in quant.w.expanded for n in held), "a matrix held expanded as well as quantized"
    assert "token_embd.weight" in held and any(k.count("+") for k in held)


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["IQ2_XXS", "IQ2_M", "IQ3_XXS", "IQ1_M", "Q2_K"])
def test_low_bit_dense_matrices_held_as_gguf_bytes(mix, synth_model):
    """The dense matrices of the low-bit mixes (IQ2_XXS/IQ2_S/IQ3_XXS/IQ1_M gates and projections,
    Q2_K/IQ3_S embeddings, Q5_K output, IQ4_NL/Q4_0 fallbacks...) held as their GGUF bytes: a
    prefill through expanded bands and one-token steps through the GEMV kernel give the logits
    of the expanded weights (float64) to fp32 round-off."""
    from sparkpack.formats.quants import kernels_read
    from sparkpack.runtime.weights import Weights

    if os.environ.get("TRITON_INTERPRET") != "1" and DEVICE == "cpu":
        pytest.skip("kernels on CPU tensors need Triton's interpreter")
    path = synth_model("qwen35moe", mix)
    ref, quant = load(path, dtype=torch.float64), load(path)
    quant.w = Weights(quant.gguf, DEVICE, torch.float32, quantized=True, int8_activations=False)
    ids = token_ids(ref.spec.n_vocab, 5)
    caches = ref.new_cache(), quant.new_cache()
    for chunk in (ids[:3], ids[3:4], ids[4:5]):
        want, got = (m.forward(chunk, c) for m, c in zip((ref, quant), caches))
        assert row_rel_err(got, want) < 1e-4, mix
    held = {quant.gguf.tensor(n.split("+")[0]).qtype for n in quant.w.as_stored}
    assert held and all(kernels_read(q) for q in held)


def test_laguna_rings_past_their_rows_match_transformers(tiny_hf_gguf, hf_ref):
    """Laguna's sliding-window layers keep rings of ``window_rows`` rows: fed far past them in
    prefill calls, decode steps and a call longer than the ring was sized for (it grows, keeping
    the window before the call), the logits are transformers' (float32) and a whole forward's (float64)."""
    from sparkpack.formats.memory import window_rows

    hf = hf_ref("laguna")
    model = load(tiny_hf_gguf("laguna")[1])
    cache = model.new_cache(calls=16)
    rings = [la for la in cache.layers if la.ring]
    assert rings and all(la.ring_rows == window_rows(model.window, 16) == 128 for la in rings)
    ids = token_ids(hf.config.vocab_size, 420, seed=5)
    cuts = [0, 40, 56, 72, 88, 104, 120, 136, 152] + list(range(153, 200)) + [360, 361, 362, 376, 392, 408, 420]
    out = torch.cat([model.forward(ids[a:b], cache) for a, b in zip(cuts, cuts[1:])])
    assert all(la.rows == window_rows(model.window, 160) for la in rings)  # the 160-token call grew them
    assert row_rel_err(out, hf_logits(hf, ids)) < 1e-4
    m64 = load(tiny_hf_gguf("laguna")[1], dtype=torch.float64)
    c64 = m64.new_cache(calls=16)
    parts = torch.cat([m64.forward(ids[a:b], c64) for a, b in zip(cuts, cuts[1:])])
    assert row_rel_err(parts, m64.forward(ids)) < 1e-10
