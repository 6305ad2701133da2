"""Generation loop, cache reuse across chat turns, and the spark-run command line."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.prefix_reuse import shared_len
from sparkpack.runtime.models import SessionOptions, StoreOptions, load_model
from tests.commands import run_cli
from tests.decode_steps import EagerStep


@pytest.fixture(scope="module")
def qwen(tiny_hf_gguf) -> Path:
    return tiny_hf_gguf("qwen3moe")[1]


@pytest.fixture(scope="module")
def qwen35(tiny_hf_gguf) -> Path:
    return tiny_hf_gguf("qwen35moe")[1]


class ScriptedSampler:
    """Returns a fixed token sequence and records the history it was shown."""

    history_free = False

    def __init__(self, tokens: list[int]):
        self.tokens, self.histories = list(tokens), []

    def sample(self, logits: torch.Tensor, history: list[int]) -> int:
        self.histories.append(list(history))
        return self.tokens.pop(0)


def test_stop_token_ends_generation_and_is_not_yielded(qwen):
    model = load_model(qwen)
    sampler = ScriptedSampler([5, 6, 7, 8, 9])
    assert list(generate(model, None, [1, 2, 3], sampler, 10, stop_ids=[7])) == [5, 6]
    assert sampler.histories == [[1, 2, 3], [1, 2, 3, 5], [1, 2, 3, 5, 6]]
    assert list(generate(model, None, [1, 2, 3], ScriptedSampler([5, 6, 7]), 2, stop_ids=[])) == [5, 6]


class ScriptedTokens:
    """A sampler's draws, made one token at a time with the history shown (the read-first loop)."""

    history_free = False

    def __init__(self, sampler):
        self.sampler = sampler

    def sample(self, logits: torch.Tensor, history: list[int]) -> int:
        return int(torch.argmax(logits)) if self.sampler is None else int(self.sampler.pick(logits))


class Interrupted(torch.Tensor):
    """A token id whose value cannot be read: Ctrl-C while the host waits for it."""

    def __getitem__(self, index):
        raise KeyboardInterrupt


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_decoding_one_step_ahead_keeps_the_session_consistent(qwen35, sampled):
    """The step that feeds a token runs before the host reads it: the same tokens as one step at a
    time, ``fed`` (and the cache) include a rejected stop token, a later feed continues from
    there, steps past the room fall back to ``feed``, a step that captures is timed as a capture,
    and an interrupt while a fed token is unread resets the session. A history-free sampler takes
    the same path with the same draws."""
    from sparkpack.runtime.sampling import Sampler

    model = load_model(qwen35)
    prompt = [1, 2, 3, 4]

    def sampler():
        return Sampler(temperature=1.3, seed=5) if sampled else None

    plain = list(generate(model, None, prompt, ScriptedTokens(sampler()), 12, stop_ids=()))
    session = Session(model, graphs=False)
    session.feed(prompt)
    session.graph = ahead = EagerStep(session, room=len(prompt) + 8, capture_at=len(prompt) + 2)
    assert list(generate(model, None, prompt, sampler(), 12, stop_ids=(), session=session)) == plain
    assert ahead.steps == 8 and session.timing.ahead_steps == 8  # then 3 steps through feed
    t = session.timing  # every step timed once, the capturing one as a capture
    assert t.decode_tokens == 10 and t.decode_seconds > 0 and t.capture_seconds > 0
    assert session.fed == prompt + plain[:-1] and session.cache.pos == len(session.fed)
    first = next(i for i in range(1, 11) if plain[i] not in plain[:i])
    session = Session(model, graphs=False)
    session.feed(prompt)
    session.graph = EagerStep(session, room=64)
    got = list(generate(model, None, prompt, sampler(), 12, stop_ids=[plain[first]], session=session))
    assert got == plain[:first] and session.fed == prompt + plain[:first + 1]
    assert session.cache.pos == len(session.fed)
    reference = Session(model, graphs=False)  # the same feeds, one token at a time after the prompt
    for j in range(len(prompt), len(prompt) + first + 3):
        want = reference.feed((prompt + plain)[:j])
    assert torch.equal(session.feed(prompt + plain[:first + 2]), want)
    session.graph = EagerStep(session, room=64)  # interrupted with a step fed whose token is unread
    with pytest.raises(KeyboardInterrupt):
        next(session.decode(want, 4, lambda logits: torch.argmax(logits).as_subclass(Interrupted)))
    assert session.fed == [] and session.cache.pos == 0


def test_session_reuses_the_cached_prefix(qwen35):
    model = load_model(qwen35, dtype=torch.float64)
    session = Session(model)
    ids = [3, 14, 15, 92, 65, 35, 89]
    first = session.feed(ids[:4])
    assert torch.equal(first, model.forward(ids[:4], last_only=True)[-1])
    second = session.feed(ids)  # extension: only the 3 new tokens are computed
    assert session.cache.pos == len(ids)
    assert torch.allclose(second, model.forward(ids)[-1], rtol=0, atol=1e-10)
    third = session.feed([3, 14, 7])  # not an extension: back to the last exact checkpoint (here none)
    assert session.cache.pos == 3
    assert torch.allclose(third, model.forward([3, 14, 7])[-1], rtol=0, atol=1e-10)


def test_session_prefills_long_prompts_in_chunks(qwen35):
    model = load_model(qwen35, dtype=torch.float64)
    ids = [(7 * i + 3) % 50 for i in range(11)]
    chunked = Session(model, prefill_chunk=4).feed(ids)
    assert torch.allclose(chunked, model.forward(ids)[-1], rtol=0, atol=1e-10)


def test_prompt_ids_logits_out_writes_every_position(qwen, tmp_path, monkeypatch, capsys):
    out = tmp_path / "l.npy"
    code, _, err = run_cli([str(qwen), "--prompt-ids", "4, 8,15", "--logits-out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    logits = np.load(out)
    ref = load_model(qwen).forward([4, 8, 15]).numpy()
    assert logits.shape == ref.shape and np.allclose(logits, ref, rtol=0, atol=1e-5)
    assert [p.name for p in tmp_path.iterdir()] == ["l.npy"]  # no temp file left behind


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,x,3", "--logits-out", "{tmp}/o.npy"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,99999", "--logits-out", "{tmp}/o.npy"], "token id 99999 is outside the vocabulary"),
    (["--prompt-ids", ",", "--logits-out", "{tmp}/o.npy"], "--prompt-ids is empty"),
    (["--logits-out", "{tmp}/o.npy"], "--logits-out needs --prompt-ids"),
    (["-p", "hi", "--prompt-ids", "1"], "either -p/--prompt or --prompt-ids"),
])
def test_bad_arguments_are_one_line_errors(qwen, tmp_path, monkeypatch, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, out, err = run_cli([str(qwen), *args], monkeypatch, capsys)
    assert code == 1
    assert err.startswith("spark-run: error: ") and message in err and err.count("\n") == 1
    assert "Traceback" not in err and not (tmp_path / "o.npy").exists()


def test_missing_and_non_gguf_model_files(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli([str(tmp_path / "nope.gguf"), "--prompt-ids", "1"], monkeypatch, capsys)
    assert code == 1 and err == f"spark-run: error: {tmp_path / 'nope.gguf'}: no such file\n"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    code, _, err = run_cli([str(junk), "--prompt-ids", "1"], monkeypatch, capsys)
    assert code == 1 and "not a GGUF file" in err and err.count("\n") == 1


def test_cuda_request_without_a_gpu_is_a_clear_error(qwen, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_cli([str(qwen), "--device", "cuda", "--prompt-ids", "1"], monkeypatch, capsys)
    assert code == 1 and "no CUDA device is available" in err and err.count("\n") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_spark_run_on_the_gpu_gives_all_gpu_logits_at_partial_residency(synth_model, tmp_path, monkeypatch, capsys):
    """Through the command line on the GPU (bf16, fused kernels): 30% of
    the experts hot, the rest streamed, writes the bits of the all-hot run."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel

    gguf = synth_model("qwen35moe", "Q4_K_M")
    ids = ",".join(str(i) for i in range(3, 60))
    got = []
    for frac in ("1.0", "0.3"):
        out = tmp_path / f"{frac}.npy"
        code, _, err = run_cli([str(gguf), "--device", "cuda", "--hot-fraction", frac, "--cache-slots", "4",
                                "--prompt-ids", ids, "--logits-out", str(out), "--no-learn"],  # (a shared model)
                               monkeypatch, capsys)
        assert code == 0, err
        got.append(np.load(out))
    assert got[0].shape == (57, model_spec(GGUFModel(gguf)).n_vocab) and np.array_equal(got[0], got[1])


@pytest.mark.parametrize("compress", [False, True])
def test_sparkpack_runs_like_its_gguf(qwen35, tmp_path, monkeypatch, capsys, compress):
    """A pack (some experts hot, the rest in cold shards, optionally zstd) gives the GGUF's logits."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.pack_writer import write_pack

    gguf = GGUFModel(qwen35)
    spec = model_spec(gguf)
    hot = np.zeros((spec.n_layer, spec.n_expert), dtype=bool)
    hot[:, ::3] = True
    pack = write_pack(gguf, spec, tmp_path / "m.sparkpack", hot, compress=compress)
    out = tmp_path / "l.npy"
    code, _, err = run_cli([str(pack), "--prompt-ids", "5,6,7,8,9", "--logits-out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    assert np.array_equal(np.load(out), load_model(qwen35).forward([5, 6, 7, 8, 9]).numpy())


def greedy_text(gguf: Path, ids: list[int], n: int) -> str:
    from sparkpack.runtime.tokenizer import GGUFTokenizer

    model = load_model(gguf)
    tok = GGUFTokenizer.from_metadata(model.gguf)
    return tok.decode(list(generate(model, tok, ids, None, n)), skip_special=True)


def hf_chat_ids(hf_dir: Path, messages: list[dict]) -> list[int]:
    """The prompt transformers' own tokenizer and template build: the referee for -p."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_raw_prompt_is_plain_continuation(qwen, monkeypatch, capsys):
    from sparkpack.runtime.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_metadata(load_model(qwen).gguf)
    code, out, err = run_cli([str(qwen), "-p", "The quick brown", "--raw", "--temperature", "0",
                              "--max-tokens", "10"], monkeypatch, capsys)
    assert code == 0, err
    assert out == greedy_text(qwen, tok.encode("The quick brown", add_special=True), 10) + "\n"


@pytest.mark.parametrize("arch", ["laguna", "qwen3moe"])
def test_chat_prompt_applies_the_template(arch, tiny_hf_gguf, monkeypatch, capsys):
    hf_dir, gguf = tiny_hf_gguf(arch)
    code, out, err = run_cli([str(gguf), "-p", "what is the capital of France?", "--temperature", "0",
                              "--max-tokens", "12"], monkeypatch, capsys)
    assert code == 0, err
    ids = hf_chat_ids(hf_dir, [{"role": "user", "content": "what is the capital of France?"}])
    assert out == greedy_text(gguf, ids, 12) + "\n"


def test_interactive_chat_keeps_the_history(tiny_hf_gguf, monkeypatch, capsys):
    import io

    hf_dir, gguf = tiny_hf_gguf("qwen35moe")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nand again\n"))
    code, out, err = run_cli([str(gguf), "--temperature", "0", "--max-tokens", "6"], monkeypatch, capsys)
    assert code == 0, err
    first = greedy_text(gguf, hf_chat_ids(hf_dir, [{"role": "user", "content": "hello"}]), 6)
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "and again"}]
    second = greedy_text(gguf, hf_chat_ids(hf_dir, history), 6)
    assert out == f"{first}\n{second}\n"


def test_sampling_is_reproducible_with_a_seed(qwen, monkeypatch, capsys):
    args = [str(qwen), "-p", "hello", "--temperature", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0",
            "--max-tokens", "16"]
    runs = [run_cli(args + ["--seed", s], monkeypatch, capsys) for s in ("7", "7", "8")]
    assert all(code == 0 for code, _, _ in runs)
    assert runs[0][1] == runs[1][1] and runs[0][1].strip()
    assert runs[0][1] != runs[2][1]


def test_q8_0_kv_cache_round_trip_and_growth():
    """Codes and scales land at their positions (int and device-scalar positions), growth keeps
    what was written, and every value comes back within half a quantization step (and the
    scale's f16 rounding)."""
    from sparkpack.runtime.cache import KVCache

    g = torch.Generator().manual_seed(0)
    kv = KVCache(4, "q8_0")
    k, v = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g) * 5
    kv.append(k, v, 0)
    k2, v2 = torch.randn(6, 2, 64, generator=g), torch.randn(6, 2, 64, generator=g)
    K, V = kv.append(k2, v2, 3)  # grows 4 -> 16
    assert kv.capacity == 16 and kv.k.dtype == torch.int8 and kv.k_scale.dtype == torch.float16
    K3, _ = kv.append(k2[:1] * 2, v2[:1], torch.tensor(9))  # a captured step's write
    want_k, want_v = torch.cat((k, k2)).transpose(0, 1), torch.cat((v, v2)).transpose(0, 1)
    for got, want in ((K[:, :9], want_k), (V[:, :9], want_v), (K3[:, 9:10], 2 * k2[:1].transpose(0, 1))):
        step = want.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / 127
        # half a step, plus the f16 rounding of the scale (up to 127 codes x 2^-11 of a step)
        assert ((got - want).unflatten(-1, (-1, 32)).abs() <= step * (0.5 + 127 / 2048) + 1e-6).all()
    assert K.dtype == torch.float32 and torch.equal(K[:, 10:], torch.zeros_like(K[:, 10:]))
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(4, "q8_0").append(torch.zeros(1, 1, 48), torch.zeros(1, 1, 48), 0)
    with pytest.raises(ValueError, match="KV cache type"):
        KVCache(4, "q4")


def test_q8_0_kv_cache_in_generation(synth_model):
    """A q8_0 KV cache changes attention inputs by quantization error only: the prompt's logits
    stay close to the bf16/f32 cache's, and a session generates with it."""
    from sparkpack.runtime.generate import Session

    model = load_model(synth_model("qwen3moe", "Q8_0"))
    ids = list(range(5, 45))
    ref = model.forward(ids)
    q8 = model.forward(ids, model.new_cache(64, "q8_0"))
    assert not torch.equal(q8, ref)
    assert float((q8 - ref).norm() / ref.norm()) < 2e-2
    session = Session(model, ctx=64, kv_type="q8_0")
    last = session.feed(ids)
    assert torch.allclose(last, q8[-1], atol=1e-5, rtol=0)
    assert session.cache.layers[0].k.dtype == torch.int8


def test_kv_type_flag_reaches_the_cache_and_the_vram_plan(synth_model, qwen, tmp_path, monkeypatch, capsys):
    """spark-run --kv-type q8_0: the logits are those of a q8_0 cache, generation runs, and the
    store's --vram plan counts 34 bytes per 32 cached values; a head size q8_0 cannot block is a
    one-line error."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.memory import kv_cache_bytes

    code, _, err = run_cli([str(qwen), "--prompt-ids", "4,5", "--kv-type", "q8_0"], monkeypatch, capsys)
    assert code == 1 and "multiple of 32" in err and qwen.name in err and "Traceback" not in err
    qwen = synth_model("qwen3moe", "Q8_0")  # head size 64

    out = tmp_path / "l.npy"
    ids = list(range(3, 40))
    code, _, err = run_cli([str(qwen), "--prompt-ids", ",".join(map(str, ids)), "--logits-out", str(out),
                            "--kv-type", "q8_0"], monkeypatch, capsys)
    assert code == 0, err
    model = load_model(qwen)
    want = model.forward(ids, model.new_cache(kv_type="q8_0")).numpy()
    assert np.allclose(np.load(out), want, rtol=0, atol=1e-5) and not np.allclose(np.load(out), model.forward(ids).numpy())
    code, _, err = run_cli([str(qwen), "--prompt-ids", "4,5", "--max-tokens", "3", "--temperature", "0",
                            "--kv-type", "q8_0", "--vram", "1GiB", "--ctx", "512", "--no-learn"],  # (a shared model)
                           monkeypatch, capsys)
    assert code == 0, err
    spec = model_spec(GGUFModel(qwen))
    q8 = load_model(qwen, store=StoreOptions(vram=2**30), session=SessionOptions(ctx=512, kv_type="q8_0")).residency.kv_bytes
    assert q8 == kv_cache_bytes(spec, 512, 34 / 32) < kv_cache_bytes(spec, 512, 4)


@pytest.mark.parametrize("kv_type", ["auto", "q8_0"])
@pytest.mark.parametrize("ctx", [256, 1024])
def test_kv_accounting_matches_the_buffers_the_session_allocates(synth_model, kv_type, ctx):
    """What --vram plans for the KV cache is what a session allocates, in either cache type:
    whole buffers for full layers, rings for sliding-window ones (at ctx 1024 the prompt goes
    past the rings' rows, which hold the window and the longest call)."""
    from sparkpack.formats.memory import KV_BYTES_PER_VALUE, kv_cache_bytes, longest_call, window_rows
    from sparkpack.runtime.cache import KVCache

    model = load_model(synth_model("laguna", "Q8_0"))  # sliding window 64 < ctx
    session = Session(model, prefill_chunk=512, ctx=ctx, kv_type=kv_type)
    session.feed([3 + i % 1500 for i in range(ctx - 100)])
    allocated = sum(t.numel() * t.element_size() for la in session.cache.layers if isinstance(la, KVCache)
                    for t in (la.k, la.v, la.k_scale, la.v_scale) if t is not None)
    per_value = 4 if kv_type == "auto" else KV_BYTES_PER_VALUE[kv_type]  # float32 activations on the CPU
    assert allocated == kv_cache_bytes(model.spec, ctx, per_value, longest_call(model.spec, ctx, kv_type, 512))
    rings = [la.rows for la in session.cache.layers if isinstance(la, KVCache) and la.ring]
    assert rings and set(rings) == {min(ctx, window_rows(model.window, 512))}


def test_prefill_chunk_temporaries_are_planned_for(synth_model):
    """--vram plans a prefill call's temporaries for the chunk the session will use: a larger
    chunk leaves less for experts, and a budget that cannot hold them says so."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.errors import SparkpackError
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.formats.memory import prefill_activation_bytes, runtime_bytes

    gguf = synth_model("qwen35moe", "Q8_0")
    spec = model_spec(GGUFModel(gguf))
    small, large = prefill_activation_bytes(spec, 64, 512), prefill_activation_bytes(spec, 4096, 512)
    assert 0 < small < large
    plans = [load_model(gguf, store=StoreOptions(vram=2**31),
                        session=SessionOptions(ctx=512, prefill_chunk=c)).residency for c in (64, 4096)]
    assert [p.overhead_bytes for p in plans] == [runtime_bytes(spec, 512, c) for c in (64, 4096)]
    assert plans[1].hot_bytes <= plans[0].hot_bytes
    need = plans[0].vram - (plans[0].overhead_bytes - small)  # what 64-token chunks leave, minus their temporaries
    with pytest.raises(SparkpackError, match="prefill chunks of 1000000"):
        load_model(gguf, store=StoreOptions(vram=need), session=SessionOptions(ctx=512, prefill_chunk=1_000_000))


def test_short_prefill_calls_depend_on_the_model_device_and_kv_type_only(synth_model):
    """Prompts go in calls of at most PREFILL_GRAPH_TOKENS exactly for all-attention models on a
    GPU in half precision with a 16-bit KV cache; nothing about the expert store enters, so the
    --vram plan can know it before the store exists."""
    from sparkpack.formats.archs import model_spec
    from sparkpack.formats.gguf_file import GGUFModel
    from sparkpack.runtime.graph import short_prefill_calls

    spec = {a: model_spec(GGUFModel(synth_model(a, "Q8_0"))) for a in ("qwen3moe", "laguna", "qwen35moe")}
    for arch in ("qwen3moe", "laguna"):
        assert short_prefill_calls("cuda", torch.bfloat16, spec[arch], "auto")
        assert short_prefill_calls(torch.device("cuda", 0), torch.float16, spec[arch], "auto")
        assert not short_prefill_calls("cuda", torch.bfloat16, spec[arch], "q8_0")
        assert not short_prefill_calls("cuda", torch.float32, spec[arch], "auto")
        assert not short_prefill_calls("cpu", torch.bfloat16, spec[arch], "auto")
    assert not short_prefill_calls("cuda", torch.bfloat16, spec["qwen35moe"], "auto")  # DeltaNet layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vram_plan_counts_short_prefill_calls(synth_model):
    """On a GPU the plan of an all-attention model counts a short call's temporaries whatever
    --prefill-chunk says (its sessions never make a longer call); a DeltaNet model's counts the
    chunk. The session feeds a long prompt in such calls."""
    from sparkpack.formats.memory import PREFILL_GRAPH_TOKENS, runtime_bytes

    for arch, chunk in (("laguna", PREFILL_GRAPH_TOKENS), ("qwen35moe", 4096)):
        model = load_model(synth_model(arch, "Q8_0"), device="cuda", dtype=torch.bfloat16,
                           store=StoreOptions(vram=2**31), session=SessionOptions(ctx=512, prefill_chunk=4096))
        assert model.residency.overhead_bytes == runtime_bytes(model.spec, 512, chunk)
    calls: list[int] = []
    model = load_model(synth_model("laguna", "Q8_0"), device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=0.5, miss_mode="async"),
                       session=SessionOptions(ctx=2048))  # a store that cannot be captured
    forward = model.forward
    model.forward = lambda ids, *a, **k: calls.append(len(ids)) or forward(ids, *a, **k)
    session = Session(model, ctx=2048, prefill_chunk=2048)
    assert session.prefill is None and session.plan.short_calls
    session.feed(list(range(3, 3 + 1100)))
    assert calls == [PREFILL_GRAPH_TOKENS, PREFILL_GRAPH_TOKENS, 1100 - 2 * PREFILL_GRAPH_TOKENS]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen35moe", "laguna"])
def test_prefill_temporaries_stay_within_the_plan(synth_model, arch):
    """The device memory a prefill call adds at its peak is at most what the plan counts: a
    prompt of a chunk and a half, so the first call attends from position 0 (torch's fused
    attention on a GPU) and the second over a past (the unfused form, scored in pieces). Laguna's
    calls of up to 512 tokens are padded and captured (``runtime.graph``): a replay allocates
    nothing, and the graphs' pool (``formats.memory.prefill_graph_bytes``) is measured against
    the plan at full size by ``bench/decode_bench.py`` (segment sizes dwarf it at tiny shapes)."""
    from sparkpack.formats.memory import PREFILL_GRAPH_TOKENS, prefill_activation_bytes

    model = load_model(synth_model(arch, "Q8_0"), device="cuda", dtype=torch.bfloat16,
                       store=StoreOptions(hot_fraction=1.0), session=SessionOptions(ctx=2048))
    for chunk in (128, 700):
        n = chunk + chunk // 2
        session = Session(model, ctx=2048, prefill_chunk=chunk)
        session.feed(list(range(3, 3 + n)))  # warm: compiles, allocates the cache
        session.reset()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        session.feed(list(range(5, 5 + n)))
        torch.cuda.synchronize()
        planned = min(chunk, PREFILL_GRAPH_TOKENS) if session.plan.short_calls else chunk  # what open_store plans
        assert torch.cuda.max_memory_allocated() - base <= prefill_activation_bytes(model.spec, planned, 2048)


def test_warm_up_leaves_no_trace(qwen35):
    """A warmed-up session gives the bits of a fresh one and reports no warm-up tokens: the
    dummy prompt is forgotten (cache, timing, store statistics)."""
    model = load_model(qwen35, store=StoreOptions(hot_fraction=0.5, cache_slots=2))
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    fresh = Session(model, ctx=128, prefill_chunk=8).feed(ids)
    model.experts.forget_traffic()
    warm = Session(model, ctx=128, prefill_chunk=8)
    assert warm.warm_up() > 0
    assert warm.timing.prefill_tokens == 0 and warm.fed == [] and model.experts.stats.tokens == 0
    assert torch.equal(warm.feed(ids), fresh)
    assert model.experts.stats.tokens == len(ids)


def test_prompt_and_ids_from_files(qwen, tmp_path, monkeypatch, capsys):
    """A 32k-token prompt is more than the OS takes as one argument: files give the same run."""
    ids = [5, 17, 42, 99, 7, 3]
    args = ["--max-tokens", "3", "--temperature", "0"]
    code, want, _ = run_cli([str(qwen), "--prompt-ids", ",".join(map(str, ids)), *args], monkeypatch, capsys)
    assert code == 0
    f = tmp_path / "ids.txt"
    f.write_text("5, 17 42\n99,7\t3\n")
    code, got, _ = run_cli([str(qwen), "--prompt-ids-file", str(f), *args], monkeypatch, capsys)
    assert code == 0 and got == want
    text = tmp_path / "p.md"
    text.write_text("Fix the failing test in utils.py\n")
    code, want, _ = run_cli([str(qwen), "-p", text.read_text(), *args], monkeypatch, capsys)
    code2, got, _ = run_cli([str(qwen), "--prompt-file", str(text), *args], monkeypatch, capsys)
    assert code == code2 == 0 and got == want
    code, _, err = run_cli([str(qwen), "--prompt-file", str(text), "-p", "x"], monkeypatch, capsys)
    assert code == 1 and "either -p/--prompt or --prompt-file" in err and "Traceback" not in err


def test_shared_len_is_the_first_difference():
    """``Session.prompt``'s shared prefix, compared a slice at a time, against the pairwise rule:
    differences inside, at and across slice borders, one list the start of the other."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 600))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for step in (1, 7, 64, 1024):
            assert shared_len(a, b, step) == shared_len(b, a, step) == want
