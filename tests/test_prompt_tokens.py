"""The server's prompt tokens (``runtime.server.prompt_tokens``): reusing a recent prompt's tokens
gives exactly the tokenizer's own, on real agent conversations turn by turn and on texts built to
put the shared part's end at every awkward place (inside an added token, right after one, where
one added token is the start of another)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.chat_template import ChatTemplate
from sparkpack.runtime.prefix_reuse import shared_len
from sparkpack.runtime.server.prompt_tokens import PromptTokens
from sparkpack.runtime.tokenizer import USER_DEFINED, GGUFTokenizer

CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "corpora" / "lucebox-hub" / "bench_agent.jsonl"


def tokenizer(path: Path, extra: tuple[str, ...] = ()) -> GGUFTokenizer:
    """The model's tokenizer, with ``extra`` added (user-defined) tokens appended."""
    g = GGUFModel(path)
    meta = {k: g.get(k) for k in g.metadata_keys if k.startswith("tokenizer.")}
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *extra]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[USER_DEFINED] * len(extra)]
    return GGUFTokenizer.from_metadata(meta)


def conversations() -> list[list[dict]]:
    """Agent conversations nobody here wrote, as their turns arrive (../shared); a written one
    where that folder is absent."""
    if CORPUS.is_file():
        out = []
        for line in CORPUS.read_text().splitlines()[:6]:
            msgs = json.loads(line)["messages"]
            system, user = msgs[0]["content"], msgs[1]["content"]
            pieces = [user[i:i + 3000] for i in range(0, min(len(user), 30000), 3000)]
            turns = [{"role": "system", "content": system}]
            for i, piece in enumerate(pieces):
                turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": piece})
            out.append(turns)
        return out
    text = "def f(x):\n    return x * 2  # ünïcödé ✓\n" * 40
    return [[{"role": "system", "content": "You are a coding agent."}]
            + [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {text}"} for i in range(8)]]


@pytest.mark.parametrize("arch", ["qwen35moe", "laguna"])
def test_each_turn_of_real_conversations_gets_the_tokenizers_tokens(synth_model, arch):
    path = synth_model(arch)
    tok = tokenizer(path)
    template = ChatTemplate.from_tokenizer(GGUFModel(path).get("tokenizer.chat_template"), tok)
    prompts = PromptTokens(tok, keep=3)
    reused = 0
    for conv in conversations():
        for n in range(2, len(conv) + 1):
            text = template.render(conv[:n], add_generation_prompt=True)
            assert prompts.encode(text) == tok.encode(text)
            reused += prompts.reused
    assert reused > 0  # (the turns did reuse: nothing above was a full encode alone)


def test_any_shared_prefix_gives_the_tokenizers_tokens(synth_model):
    """Random texts of bits that the added tokens and the pre-tokenizer split on, including the
    fragments of added tokens and an added token that begins another (``<|a|>`` in ``<|a|>b``),
    each sharing a random length with an earlier one."""
    tok = tokenizer(synth_model("qwen35moe"), extra=("<|a|>", "<|a|>b", "ab<|"))
    bits = ["<|im_start|>", "<|im_end|>", "<|im_", "|>", "<|a|>", "<|a|>b", "b", "ab<|", "<|", "a", " ", "\n",
            "  ", "user", "assistant", "x1", "é", "✓", "<think>", "</think>", "<tool_call>", "{\"k\": 1}", "'s"]
    rng = random.Random(0)
    prompts = PromptTokens(tok, keep=4)
    texts = ["".join(rng.choice(bits) for _ in range(200))]
    for _ in range(400):
        base = rng.choice(texts)
        cut = rng.randrange(len(base) + 1)
        text = base[:cut] + "".join(rng.choice(bits) for _ in range(rng.randrange(0, 40)))
        assert prompts.encode(text) == tok.encode(text), text
        texts.append(text)
    assert prompts.reach == len("<|object_ref_start|>")


def test_shared_prefix():
    assert shared_len("", "abc") == 0 and shared_len("abc", "abc") == 3
    assert shared_len("abcd", "abxd") == 2 and shared_len("ab", "abc") == 2
