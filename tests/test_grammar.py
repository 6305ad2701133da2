"""Constrained decoding (runtime.grammar) on the tiny synthetic models of every arch: their random
weights never write JSON on their own, so a reply that parses and matches its schema is the
grammar's doing; the constrained loop's tokens are the unconstrained loop's where it allows all."""
from __future__ import annotations

import json

import pytest
import torch

from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.chat_template import ChatTemplate
from sparkpack.runtime.generate import Session, continue_tokens
from sparkpack.runtime.grammar import GrammarError, SchemaGrammars
from sparkpack.runtime.graph import capturable
from sparkpack.runtime.models import StoreOptions, load_model
from sparkpack.runtime.sampling import Sampler
from sparkpack.runtime.tokenizer import BYTE, CONTROL, NORMAL, GGUFTokenizer
from tests.schema_check import problems
from tests.marks import quick_first
from tests.serve_proc import one_thread

ARCHS = ("qwen35moe", "qwen3moe", "laguna")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VERDICT = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "count", "note"],
           "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                          "count": {"type": "integer", "minimum": 0, "maximum": 99},
                          "note": {"type": "string", "maxLength": 16}}}


class Loaded:
    """A model, its tokenizer and grammars, and a chat prompt; on the GPU in bfloat16 with every
    expert resident (zero-copy: decode steps are captured and run one step ahead)."""

    def __init__(self, path, device: str = "cpu"):
        gguf = GGUFModel(path)
        self.tok = GGUFTokenizer.from_metadata(gguf)
        resident = StoreOptions(hot_fraction=1.0, cache_slots=0, miss_mode="zerocopy")
        self.model = load_model(path) if device == "cpu" else load_model(path, device=device, dtype=torch.bfloat16,
                                                                          store=resident)
        self.grammars = SchemaGrammars(self.tok, self.model.spec.n_vocab)
        template = ChatTemplate.from_tokenizer(gguf.get("tokenizer.chat_template"), self.tok)
        text = template.render([{"role": "user", "content": "Is it red?"}], add_generation_prompt=True,
                               enable_thinking=False)
        self.prompt = self.tok.encode(text)

    def reply(self, constraint, sampler=None, n: int = 120) -> list[int]:
        return self.replied(constraint, sampler, n)[0]

    def replied(self, constraint, sampler=None, n: int = 120) -> tuple[list[int], Session]:
        with one_thread():  # (several threads on the shared CI cores are many times slower)
            session = Session(self.model, prefill_chunk=16, ctx=512, breaks=self.tok.control_ids)
            logits = session.prompt(self.prompt)
            return list(continue_tokens(session, logits, sampler, n, self.tok.stop_ids, constraint)), session


class Everything:
    """A grammar that allows every token (and records them)."""

    def __init__(self):
        self.accepted: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def accept(self, token: int) -> None:
        self.accepted.append(token)


@pytest.fixture(scope="module", params=quick_first(ARCHS))
def loaded(request, synth_model) -> Loaded:
    return Loaded(synth_model(request.param))


def test_json_schema_replies_parse_and_match_on_every_arch(loaded):
    """Greedy and sampled: the text is JSON that matches the schema, and it ends by itself (a stop
    token once the object closes); greedy is deterministic."""
    unconstrained = loaded.tok.decode(loaded.reply(None, n=40))
    with pytest.raises(ValueError):
        json.loads(unconstrained)  # (the model alone writes no JSON: the grammar is what the test sees)
    greedy = loaded.reply(loaded.grammars.json_schema(VERDICT))
    assert len(greedy) < 120 and greedy == loaded.reply(loaded.grammars.json_schema(VERDICT))
    for ids in (greedy, loaded.reply(loaded.grammars.json_schema(VERDICT), Sampler(temperature=1.5, seed=3))):
        value = json.loads(loaded.tok.decode(ids))
        assert problems(value, VERDICT) == [], value


def test_a_grammar_that_allows_everything_changes_no_token(loaded):
    """The constrained loop (one token at a time) gives the tokens of the unconstrained one."""
    free = Everything()
    got = loaded.reply(free, n=12)
    assert got == loaded.reply(None, n=12) and free.accepted[:len(got)] == got


@cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_on_the_gpu_constrained_replies_take_the_synchronous_loop_with_the_same_tokens(synth_model, arch):
    """Unconstrained, decode steps run one step ahead from the captured graph; a grammar's reply
    runs one step at a time (nothing ahead) and, where it allows everything, gives the same tokens;
    a schema's reply on the GPU parses and matches."""
    loaded = Loaded(synth_model(arch, "Q4_K_M", skew=1.0), device="cuda")
    if not capturable(loaded.model):
        pytest.skip("not every expert layer has fused-kernel quant types")
    free, session = loaded.replied(None, n=24)
    assert session.timing.ahead_steps > 0
    allowed, session = loaded.replied(Everything(), n=24)
    assert allowed == free and session.timing.ahead_steps == 0
    value = json.loads(loaded.tok.decode(loaded.reply(loaded.grammars.json_schema(VERDICT))))
    assert problems(value, VERDICT) == [], value


def test_the_mask_keeps_special_tokens_out_and_ends_with_the_end_of_turn(synth_model):
    loaded = Loaded(synth_model("qwen35moe"))
    tok = loaded.tok
    grammar = loaded.grammars.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    logits = torch.zeros(loaded.model.spec.n_vocab)
    first = torch.isfinite(grammar.mask(logits)).nonzero().flatten().tolist()
    assert [tok.decode([t]) for t in first] == ["{"]
    control = [i for i, kind in enumerate(tok.token_types) if kind == CONTROL]
    # a tag's text is fine inside a string when spelled in plain tokens, never as the tag's own token
    for t in tok.encode('{"a":"<') + tok.encode('think> x"}'):
        allowed = torch.isfinite(grammar.mask(logits))
        assert allowed[t], tok.decode([t])
        assert not allowed[control].any() and not allowed[tok.token_to_id("<think>")]
        grammar.accept(t)
    assert torch.isfinite(grammar.mask(logits)).nonzero().flatten().tolist() == [tok.end_of_turn]
    with pytest.raises(RuntimeError, match="not allowed"):
        grammar.accept(tok.encode("x")[0])


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "nope"}, "nope"),
    ({"$ref": "#/definitions/missing"}, "missing"),
])
def test_a_schema_the_library_cannot_compile_is_a_grammar_error(synth_model, schema, words):
    tok = GGUFTokenizer.from_metadata(GGUFModel(synth_model("qwen35moe")))
    with pytest.raises(GrammarError, match=words) as e:
        SchemaGrammars(tok, tok.vocab_size).json_schema(schema)
    assert "\n" not in e.value.message


def real_vocab(tmp_path, name: str) -> GGUFTokenizer:
    """A real model's tokenizer: llama.cpp's vocabulary-only GGUF (``models/ggml-vocab-NAME.gguf``)
    from the llama-cpp-python source package the README's test command downloads."""
    from tests.paths import SDIST_HINT, llama_cpp_model_file

    data = llama_cpp_model_file(name)
    if data is None:
        pytest.skip(SDIST_HINT)
    path = tmp_path / name
    path.write_bytes(data)
    return GGUFTokenizer.from_metadata(GGUFModel(path))


@pytest.mark.slow
def test_a_real_vocabulary_takes_any_text_inside_strings_and_nothing_special(tmp_path):
    """Qwen3.5's real vocabulary: accented letters, CJK, an emoji split across byte-level
    tokens, escapes; each token of the real tokenizer's encoding passes the mask, no control or
    tag token ever does, and the end of turn alone follows the closed object."""
    tok = real_vocab(tmp_path, "ggml-vocab-qwen35.gguf")
    schema = {"type": "object", "required": ["title", "n", "tags"],
              "properties": {"title": {"type": "string"}, "n": {"type": "integer"},
                             "tags": {"type": "array", "items": {"type": "string"}}}}
    grammar = SchemaGrammars(tok, tok.vocab_size).json_schema(schema)
    text = json.dumps({"title": "Ünïcødé — 漢字 🎉 \"quoted\"\n<think>", "n": -42, "tags": ["a b", ""]},
                      ensure_ascii=False, separators=(",", ":"))
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and any(len(tok.token_bytes(i)) > 1 for i in ids)
    special = [i for i, kind in enumerate(tok.token_types) if kind not in (NORMAL, BYTE)]
    assert len(special) > 200  # (control tokens, tags and [PAD] fillers)
    logits = torch.zeros(tok.vocab_size)
    for t in ids:
        allowed = torch.isfinite(grammar.mask(logits))
        assert allowed[t], tok.decode([t])
        assert not allowed[special].any()
        grammar.accept(t)
    assert torch.isfinite(grammar.mask(logits)).nonzero().flatten().tolist() == [tok.end_of_turn]
