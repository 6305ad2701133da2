"""repack calibrate: rendering, routing counts against transformers, resume, traces, evaluation, bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from sparkpack.calibrate.conversation import Conversation
from sparkpack.calibrate.evaluate import cold_rate, cold_rate_lru
from sparkpack.calibrate.readers import read_corpus
from sparkpack.calibrate.trace import MAGIC, TraceWriter, read_trace
from sparkpack.formats.archs import model_spec
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.repack.calibrate_cmd import calibrate_cmd
from sparkpack.runtime.calibration import open_router
from sparkpack.runtime.options import run_options
from tests.commands import calibrate_in_process
from tests.paths import SHARED_CORPORA

REPO = Path(__file__).resolve().parents[1]
CHAT = Conversation(messages=[
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
], source="test")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matmuls on a shared 2-core machine: a second thread only adds contention (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def calibrate(*args: str) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess: what a user sees, exit code and the one error line."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "calibrate", *map(str, args), "--quiet"],
                          capture_output=True, text=True, cwd=REPO, env=env)


def renderer_of(path: Path):
    """The renderer calibrate uses for this model: its template and tokenizer."""
    from sparkpack.calibrate.render import ChatRenderer

    router = open_router(run_options(path, device="cpu", ctx=512, prefill_chunk=512, no_learn=True))
    return ChatRenderer(router.tokenizer, router.render_chat)


# --- rendering --------------------------------------------------------------------------------

@pytest.mark.slow
def test_rendering_uses_the_model_template(tiny_hf_gguf):
    """Text equals the GGUF template rendered directly and transformers' apply_chat_template;
    ids equal the HF tokenizer's; the generated mask covers exactly the assistant turns."""
    from transformers import AutoTokenizer

    from sparkpack.runtime.chat_template import render_chat

    hf_dir, path = tiny_hf_gguf("qwen3moe")
    gguf = GGUFModel(path)
    renderer = renderer_of(path)
    r = renderer.render(CHAT)
    assert r.text == render_chat(gguf.get("tokenizer.chat_template"), CHAT.messages, add_generation_prompt=False)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    assert r.text == hf_tok.apply_chat_template(CHAT.messages, tokenize=False)
    assert r.ids == hf_tok(r.text, add_special_tokens=False)["input_ids"]

    tok = renderer.tokenizer
    gen_runs, cur = [], []
    for i, g in zip(r.ids, r.generated):
        if g:
            cur.append(i)
        elif cur:
            gen_runs.append(tok.decode(cur))
            cur = []
    assert gen_runs == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]


@pytest.mark.slow
def test_prompt_list_gets_generation_prompt_and_no_generated_side(tiny_hf_gguf):
    _, path = tiny_hf_gguf("qwen3moe")
    renderer = renderer_of(path)
    r = renderer.render(Conversation(messages=[{"role": "user", "content": "hi"}], source="t"))
    assert r.text.endswith("<|im_start|>assistant\n")
    assert not r.generated.any()


# --- counts against transformers ----------------------------------------------------------------

def test_counts_equal_transformers_router_choices(tiny_hf_gguf, tmp_path):
    """Profile counts = bincount of the HF router's own top-k on the same tokens, per side."""
    from tests.hf_tiny import load_tiny_hf

    hf_dir, path = tiny_hf_gguf("qwen3moe")
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text(json.dumps({"messages": CHAT.messages}) + "\n"
                      + json.dumps({"prompt": "def main():\n    print('hello world')"}) + "\n")
    out = tmp_path / "p.json"
    calibrate_in_process(path, "--corpus", corpus, "-o", out, "--prefill-chunk", "7", "--ctx", "512")
    prof = json.loads(out.read_text())

    hf = load_tiny_hf(hf_dir)
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2]))
             for layer in hf.model.layers]
    renderer = renderer_of(path)
    n_layer, n_expert = len(hf.model.layers), hf.config.num_experts
    ref = {"prompt": np.zeros((n_layer, n_expert)), "generated": np.zeros((n_layer, n_expert))}
    convs, _ = read_corpus(corpus)
    for conv in convs:
        r = renderer.render(conv)
        chosen.clear()
        with torch.no_grad():
            hf(torch.tensor([r.ids]))
        for il, ids in enumerate(chosen):
            ids = ids.reshape(len(r.ids), -1).numpy()
            ref["generated"][il] += np.bincount(ids[r.generated].ravel(), minlength=n_expert)
            ref["prompt"][il] += np.bincount(ids[~r.generated].ravel(), minlength=n_expert)
    for h in hooks:
        h.remove()
    assert ref["generated"].sum() > 0 and ref["prompt"].sum() > 0
    for side in ("prompt", "generated"):
        assert np.array_equal(np.array(prof["counts"][side]), ref[side]), side


# --- resume, windows, traces ------------------------------------------------------------------

def test_resume_gives_the_uninterrupted_profile_and_trace(synth_model, tmp_path):
    model = synth_model("qwen3moe", skew="reference")
    texts = ["alpha beta", "gamma delta epsilon", "alpha beta", "zeta eta theta iota", "kappa", "lambda mu nu"]
    corpus = write_prompts(tmp_path / "c.jsonl", texts)  # "alpha beta" twice: skipped only once on resume
    whole, part = tmp_path / "whole.json", tmp_path / "part.json"
    out = calibrate_in_process(model, "--corpus", corpus, "-o", whole, "--trace", tmp_path / "whole.trace", "--ctx", "9",
                 "--prefill-chunk", "4")
    assert "split into windows" in out  # the chats are longer than 9 tokens

    common = ["--corpus", corpus, "-o", part, "--trace", tmp_path / "part.trace", "--ctx", "9", "--prefill-chunk", "4"]
    calibrate_in_process(model, *common, "--stop-after", "3")
    assert not part.exists() and (tmp_path / "part.json.checkpoint.json").exists()
    calibrate_in_process(model, *common, "--resume")
    assert not (tmp_path / "part.json.checkpoint.json").exists()
    a, b = json.loads(whole.read_text()), json.loads(part.read_text())
    assert a["counts"] == b["counts"] and a["tokens"] == b["tokens"]
    ta, tb = read_trace(tmp_path / "whole.trace"), read_trace(tmp_path / "part.trace")
    assert ta.n_tokens == sum(a["tokens"].values()) and np.array_equal(ta.ids, tb.ids)
    assert np.array_equal(ta.generated, tb.generated)
    # the trace holds the very routings that were counted
    counted = np.array(a["counts"]["prompt"]) + np.array(a["counts"]["generated"])
    for j, il in enumerate(ta.moe_layers):
        assert np.array_equal(np.bincount(ta.ids[:, j].ravel(), minlength=ta.n_expert), counted[il])


def test_refused_conversations_are_reported_and_not_recounted_on_resume(synth_model):
    """A conversation the template refuses is skipped with its reason, and a resumed run that
    starts after it neither retries it nor counts the skip twice."""
    from sparkpack.calibrate.render import ChatRenderer
    from sparkpack.calibrate.replay import Replayer, ReplayState
    from sparkpack.formats.errors import SparkpackError
    from sparkpack.runtime.chat_template import ChatTemplate

    path = synth_model("qwen3moe", skew="reference")
    gguf = GGUFModel(path)
    convs = [Conversation(messages=[{"role": "user", "content": t}], source="t") for t in ("a b", "REFUSE", "c d")]

    def replayer() -> Replayer:
        router = open_router(run_options(path, device="cpu", ctx=64, prefill_chunk=16, no_learn=True))
        tmpl = ChatTemplate.from_tokenizer(gguf.get("tokenizer.chat_template"), router.tokenizer)

        def render(messages, **kw):
            if messages and messages[0]["content"] == "REFUSE":
                raise SparkpackError("tokenizer.chat_template", "template failed to render: no")
            return tmpl.render(messages, **kw)

        return Replayer(router, ChatRenderer(router.tokenizer, render), ctx=64)

    spec = model_spec(gguf)
    shape = (2, spec.n_layer, spec.n_expert)
    whole = replayer().replay(convs, ReplayState(counts=np.zeros(shape, np.int64)))
    assert whole.skipped == {"template refused: template failed to render: no": 1}
    first = replayer().replay(convs[:2], ReplayState(counts=np.zeros(shape, np.int64)))
    resumed = ReplayState.from_json(json.loads(json.dumps(first.to_json())), shape)
    resumed = replayer().replay(convs, resumed, skip=list(resumed.done))
    assert resumed.skipped == whole.skipped and resumed.tokens == whole.tokens
    assert np.array_equal(resumed.counts, whole.counts) and resumed.conversations == whole.conversations == 2


def test_merge_applies_decay(synth_model, tmp_path):
    model = synth_model("qwen3moe", skew="reference")
    corpus = write_prompts(tmp_path / "c.jsonl", ["one two three", "four five"])
    out, once = tmp_path / "p.json", tmp_path / "once.json"
    calibrate_in_process(model, "--corpus", corpus, "-o", once)
    calibrate_in_process(model, "--corpus", corpus, "-o", out)
    calibrate_in_process(model, "--corpus", corpus, "-o", out, "--merge", "--decay", "0.25")
    single, merged = json.loads(once.read_text()), json.loads(out.read_text())
    for side in ("prompt", "generated"):
        assert np.allclose(np.array(merged["counts"][side]), 1.25 * np.array(single["counts"][side]))


def test_trace_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, size=(50, 3, 2))
    gen = rng.random(50) < 0.3
    w = TraceWriter(tmp_path / "t.trace", [1, 2, 4], 2, 300, {"arch": "x"})
    w.append(ids[:20], gen[:20])
    w.append(ids[20:], gen[20:])
    w.close()
    t = read_trace(tmp_path / "t.trace")
    assert t.ids.dtype == np.uint16 and np.array_equal(t.ids, ids) and np.array_equal(t.generated, gen)
    assert t.moe_layers == [1, 2, 4] and t.meta["arch"] == "x"


# --- evaluation -------------------------------------------------------------------------------

def lru_reference(ids: np.ndarray, hot: np.ndarray, slots: int) -> float:
    """Plain per-layer OrderedDict LRU: the definition cold_rate_lru vectorises."""
    cold = 0
    for j in range(ids.shape[1]):
        cache: OrderedDict[int, None] = OrderedDict()
        for t in range(ids.shape[0]):
            for e in ids[t, j]:
                e = int(e)
                if hot[j, e]:
                    continue
                if e in cache:
                    cache.move_to_end(e)
                else:
                    cold += 1
                    cache[e] = None
            while len(cache) > slots:
                cache.popitem(last=False)
    return cold / ids.size


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_lru_simulation_matches_reference(slots):
    rng = np.random.default_rng(slots)
    n, layers, n_expert, k = 300, 3, 12, 2
    p = np.exp(rng.standard_normal(n_expert) * 1.5)
    ids = np.stack([[rng.choice(n_expert, size=k, replace=False, p=p / p.sum()) for _ in range(layers)]
                    for _ in range(n)])
    hots = np.stack([rng.random((layers, n_expert)) < 0.3, np.zeros((layers, n_expert), bool)])
    got = cold_rate_lru(ids, hots, slots)
    for m in range(2):
        assert got[m] == pytest.approx(lru_reference(ids, hots[m], slots))
        assert got[m] <= cold_rate(ids, hots[m])


def test_calibrated_placement_misses_less_than_uniform(synth_model, tmp_path):
    """Calibrate on the project's sample corpus, evaluate on other prompts (the held-out traffic)."""
    model = synth_model("qwen3moe", skew="reference")
    prof = tmp_path / "p.json"
    calibrate_in_process(model, "--corpus", REPO / "corpora" / "openai_chat.jsonl", "-o", prof)
    held = write_prompts(tmp_path / "held.jsonl", [
        "Summarise the design of a key-value store with a write-ahead log.",
        "for i in range(10):\n    print(i * i)  # squares",
        "Translate to French: the weather is nice today and the dog sleeps.",
    ])
    out = calibrate_in_process(model, "--eval", held, "--profile", prof, "--cache-slots", "2", "--json")
    rows = {r["fraction"]: r for r in json.loads(out)["rows"]}
    r60 = rows[0.6]
    assert r60["profile"] < 0.5 * r60["uniform"]
    assert r60["profile_lru"] <= r60["profile"] and r60["uniform_lru"] < r60["uniform"]
    assert [rows[f]["profile"] for f in (0.2, 0.4, 0.6, 0.8)] == sorted(
        (rows[f]["profile"] for f in (0.2, 0.4, 0.6, 0.8)), reverse=True)

    table = calibrate_in_process(model, "--eval", held, "--profile", prof)
    assert "60%" in table and "uniform" in table and "37.5%" in table  # 10 of 16 experts hot


def test_calibrates_on_the_real_shared_corpora(synth_model, tmp_path):
    if not SHARED_CORPORA.is_dir():
        pytest.skip(f"real-data folder {SHARED_CORPORA} is absent")
    model = synth_model("qwen3moe", skew="reference")
    out = calibrate_in_process(model, "--corpus", SHARED_CORPORA, "-o", tmp_path / "p.json", "--max-tokens", "600")
    prof = json.loads((tmp_path / "p.json").read_text())
    assert sum(prof["tokens"].values()) == 600 and "stopped at --max-tokens" in out


# --- what calibrate says while it works -------------------------------------------------------------

def replay_bars(stderr: str) -> list[str]:
    return [b for b in stderr.replace("\r", "\n").splitlines() if b.startswith("replay:")]


@pytest.mark.parametrize("n_prompts, max_tokens", [(12, 100000), (12, 50)])
def test_progress_has_a_total_and_ends_at_100_percent(synth_model, tmp_path, n_prompts, max_tokens):
    """The total is known before replay: the corpus's tokens, or --max-tokens when that is fewer."""
    model = synth_model("qwen3moe")
    corpus = write_prompts(tmp_path / "c.jsonl", [f"prompt number {i} with some words" for i in range(n_prompts)])
    res = CliRunner().invoke(calibrate_cmd, [str(model), "--corpus", str(corpus), "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    tokens = sum(json.loads((tmp_path / "p.json").read_text())["tokens"].values())
    res = CliRunner().invoke(calibrate_cmd, [str(model), "--corpus", str(corpus), "-o", str(tmp_path / "q.json"),
                                             "--max-tokens", str(max_tokens)])
    assert res.exit_code == 0, res.output
    from tqdm import tqdm

    total = tqdm.format_sizeof(min(tokens, max_tokens))  # as the bar prints it
    bars = replay_bars(res.stderr)
    assert bars and all(f"/{total} [" in b for b in bars), bars  # every bar has the total, with an ETA
    assert bars[-1].startswith("replay: 100%") and f"| {total}/{total} [" in bars[-1] and "<" in bars[0]
    assert "warning" not in res.stderr


def test_a_corpus_too_small_to_place_experts_is_warned_about(synth_model, tmp_path):
    """16 experts, top-4: 40 tokens route each expert 10 times on average (calibrate.evaluate)."""
    from sparkpack.calibrate.evaluate import min_calibration_tokens

    model = synth_model("qwen3moe")
    spec = model_spec(GGUFModel(model))
    assert min_calibration_tokens(spec.n_expert, spec.n_expert_used) == 40
    corpus = write_prompts(tmp_path / "c.jsonl", ["hi"])
    res = CliRunner().invoke(calibrate_cmd, [str(model), "--corpus", str(corpus), "-o", str(tmp_path / "p.json"),
                                             "--quiet"])
    assert res.exit_code == 0, res.output
    tokens = sum(json.loads((tmp_path / "p.json").read_text())["tokens"].values())
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and f"only {tokens} tokens" in warnings[0] and "at least 40 tokens" in warnings[0]
    assert "beside" not in warnings[0]
    shown = subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "inspect", str(tmp_path / "p.json")],
                           capture_output=True, text=True, cwd=REPO)
    assert f"only {tokens} tokens" in shown.stdout


# --- bad input through the CLI -------------------------------------------------------------------

def one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_missing_corpus(synth_model, tmp_path):
    line = one_error_line(calibrate(synth_model("qwen3moe"), "--corpus", tmp_path / "nope"))
    assert "nope: no such file or folder" in line
    (tmp_path / "empty").mkdir()
    line = one_error_line(calibrate(synth_model("qwen3moe"), "--corpus", tmp_path / "empty", "--trace",
                                    tmp_path / "t.trace", "-o", tmp_path / "p.json"))
    assert "empty: nothing to replay (0 files" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no profile, no partial trace


def test_an_empty_corpus_is_refused_before_the_model_loads(synth_model, tmp_path):
    """On a GPU loading and warming a model up takes a minute: a corpus with nothing to replay
    (a missing path, an empty folder, files of no conversation) is refused before that."""
    from sparkpack.formats.errors import SparkpackError
    from sparkpack.formats.profile import model_identity
    from sparkpack.repack.calibrate_cmd import calibrate_options, run_calibrate

    path = synth_model("qwen3moe")
    gguf = GGUFModel(path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.jsonl").write_text("\n\n")

    def connect():
        pytest.fail("the model was loaded for a corpus with nothing to replay")

    for corpus, says in [(tmp_path / "nope", "no such file or folder"), (tmp_path / "empty", "nothing to replay"),
                         (tmp_path / "blank.jsonl", "nothing to replay")]:
        opts = calibrate_options(path, corpus=corpus, output=tmp_path / "p.json", ctx=4096, prefill_chunk=2048,
                                 device="cpu", quiet=True)
        with pytest.raises(SparkpackError, match=says):
            run_calibrate(opts, model_spec(gguf), model_identity(gguf), connect)
    assert not (tmp_path / "p.json").exists()


def test_not_a_moe_model(tmp_path):
    import gguf

    path = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    line = one_error_line(calibrate(path, "--corpus", REPO / "corpora" / "prompts.jsonl"))
    assert "architecture 'llama' is not a mixture-of-experts model" in line


def test_profile_of_another_model_is_refused(synth_model, tmp_path):
    model = synth_model("qwen3moe", skew="reference")
    prof = tmp_path / "p.json"
    calibrate_in_process(model, "--corpus", write_prompts(tmp_path / "c.jsonl", ["hello"]), "-o", prof)
    d = json.loads(prof.read_text())
    d["identity"]["header_hash"] = "sha256:" + "0" * 64
    prof.write_text(json.dumps(d))
    line = one_error_line(calibrate(model, "--eval", tmp_path / "c.jsonl", "--profile", prof))
    assert "profile is for another model" in line
    line = one_error_line(calibrate(model, "--corpus", tmp_path / "c.jsonl", "-o", prof, "--merge"))
    assert "profile is for another model" in line


def test_malformed_trace(synth_model, tmp_path):
    model = synth_model("qwen3moe", skew="reference")
    prof = tmp_path / "p.json"
    calibrate_in_process(model, "--corpus", write_prompts(tmp_path / "c.jsonl", ["hello"]), "-o", prof, "--trace",
           tmp_path / "t.trace")
    data = (tmp_path / "t.trace").read_bytes()
    (tmp_path / "cut.trace").write_bytes(data[:-3])
    line = one_error_line(calibrate(model, "--eval", tmp_path / "cut.trace", "--profile", prof))
    assert "cut.trace: trace is" in line and "truncated" in line
    (tmp_path / "short.trace").write_bytes(MAGIC + b"\x01")
    line = one_error_line(calibrate(model, "--eval", tmp_path / "short.trace", "--profile", prof))
    assert "too short to be a routing trace" in line


def test_eval_without_profile_and_both_modes(synth_model, tmp_path):
    model = synth_model("qwen3moe")
    line = one_error_line(calibrate(model, "--eval", REPO / "corpora" / "prompts.jsonl", "--profile",
                                    tmp_path / "none.json"))
    assert "none.json: no such profile" in line
    line = one_error_line(calibrate(model))
    assert "--corpus is required" in line
