"""The GGUF-built tokenizer must give the ids of the HF tokenizer.json it was converted from."""
from __future__ import annotations

import json

import pytest

from sparkpack.formats.errors import SparkpackError
from sparkpack.repack.convert_hf.vocab import CONTROL
from sparkpack.runtime.tokenizer import GGUFTokenizer
from tests.hf_tiny import build_tokenizer, tokenizer_metadata

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    print('hello world')\n\treturn 0\n\n\n",
    "Numbers 1234567 and 3.14159, x=-42; I'm sure they'll do it. DON'T",
    "emoji 😀👍🏽 and CJK 你好，世界 and こんにちは",
    "combining: cafe\u0301 nai\u0308ve a\u0300\u0301\u0302 Ω≈ç√",
    "   leading spaces, trailing   \n  \n\t\t tabs   ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "",
]


def _hf_with_splits(hf_dir, regexes: list[str]):
    """The same tokenizer.json with its split regexes replaced, loaded by `tokenizers` itself."""
    from tokenizers import Tokenizer

    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    byte_level = tj["pre_tokenizer"]["pretokenizers"][-1]
    tj["pre_tokenizer"]["pretokenizers"] = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in regexes
    ] + [byte_level]
    return Tokenizer.from_str(json.dumps(tj))


QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen_tok")
    build_tokenizer("qwen3moe", d)
    return d


@pytest.fixture(scope="module")
def laguna_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("laguna_tok")
    build_tokenizer("laguna", d)
    return d


@pytest.mark.parametrize("pre,regexes", [("qwen2", [QWEN2]), ("qwen35", [QWEN35]),
                                         ("laguna", [r"[^\n]+|[\n]+", QWEN2])])
def test_ids_match_hf_tokenizer(qwen_dir, pre, regexes):
    from tokenizers import Tokenizer

    ours = GGUFTokenizer.from_metadata(tokenizer_metadata(qwen_dir, pre))
    hf = Tokenizer.from_file(str(qwen_dir / "tokenizer.json")) if pre == "qwen2" else _hf_with_splits(qwen_dir, regexes)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text)) == text


def test_pre_tokenizers_really_differ(qwen_dir):
    """The qwen35 pattern keeps combining marks with their letter; laguna cuts at newlines first."""
    q2 = GGUFTokenizer.from_metadata(tokenizer_metadata(qwen_dir, "qwen2"))
    q35 = GGUFTokenizer.from_metadata(tokenizer_metadata(qwen_dir, "qwen35"))
    lag = GGUFTokenizer.from_metadata(tokenizer_metadata(qwen_dir, "laguna"))
    assert len(q2.pre_tokenize("cafe\u0301s")) == 2 and len(q35.pre_tokenize("cafe\u0301s")) == 1
    assert q2.pre_tokenize("ab  \ncd") != lag.pre_tokenize("ab  \ncd")


def test_special_tokens_single_ids_and_stops(qwen_dir):
    tok = GGUFTokenizer.from_metadata(tokenizer_metadata(qwen_dir, "qwen2"))
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    assert end in tok.stop_ids and tok.token_to_id("<|endoftext|>") in tok.stop_ids
    assert start not in tok.stop_ids
    assert tok.eos_id == end and tok.bos_id is None
    assert tok.encode("hi", add_special=True) == tok.encode("hi")  # Qwen adds no BOS
    assert tok.vocab_size == len(tokenizer_metadata(qwen_dir, "qwen2")["tokenizer.ggml.tokens"])


def test_laguna_bos_and_turn_end(laguna_dir):
    md = tokenizer_metadata(laguna_dir, "laguna")
    tok = GGUFTokenizer.from_metadata(md)
    assert tok.encode("hi", add_special=True) == [tok.bos_id, *tok.encode("hi")]
    assert tok.token_to_id("</assistant>") in tok.stop_ids
    assert md["tokenizer.ggml.token_type"][tok.token_to_id("</assistant>")] == CONTROL


def test_streaming_never_splits_characters(qwen_dir):
    tok = GGUFTokenizer.from_metadata(tokenizer_metadata(qwen_dir, "qwen2"))
    text = "emoji 😀👍🏽 CJK 你好 mixed<|im_end|> done é"
    ids = tok.encode(text)
    assert any(len(tok.token_bytes(i)) and not _is_utf8(tok.token_bytes(i)) for i in ids)  # some split chars
    s = tok.decoder()
    pieces = [s.push(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    quiet = tok.decoder(skip_special=True)
    assert "".join(quiet.push(i) for i in ids) + quiet.flush() == text.replace("<|im_end|>", "")


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_gguf_model_source(qwen_dir, tmp_path):
    """Built from a real GGUF file through formats.gguf_file.GGUFModel."""
    import gguf

    from sparkpack.formats.gguf_file import GGUFModel

    md = tokenizer_metadata(qwen_dir, "qwen2")
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFModel(path) as m:
        tok = GGUFTokenizer.from_metadata(m)
    ref = GGUFTokenizer.from_metadata(md)
    assert tok.encode(TEXTS[3]) == ref.encode(TEXTS[3])


@pytest.mark.parametrize("change,message", [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer model 'llama' is not supported"),
    ({"tokenizer.ggml.pre": "bloom"}, "unsupported pre-tokenizer 'bloom'"),
    ({"tokenizer.ggml.merges": []}, "merges is missing or empty"),
])
def test_unsupported_tokenizers_are_user_errors(qwen_dir, change, message):
    md = {**tokenizer_metadata(qwen_dir, "qwen2"), **change}
    with pytest.raises(SparkpackError, match=message):
        GGUFTokenizer.from_metadata(md)


def test_a_merge_of_unknown_tokens_is_a_user_error(qwen_dir):
    """A merge whose halves or result are not tokens (a mutated file: the fuzzer found one) is
    one line naming both fields, not the tokenizer library's exception."""
    md = tokenizer_metadata(qwen_dir, "qwen2")
    md = {**md, "tokenizer.ggml.merges": md["tokenizer.ggml.merges"] + ["\u0120zz\u00e9 q\u00e9q"]}
    with pytest.raises(SparkpackError, match=r"tokenizer.ggml.merges does not fit tokenizer.ggml.tokens"):
        GGUFTokenizer.from_metadata(md)


def test_unsupported_tokenizer_names_the_file(tmp_path):
    """A GGUF with an SPM tokenizer: the one-line error names the file and the tokenizer model."""
    import gguf

    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from sparkpack.formats.gguf_file import GGUFModel

    with GGUFModel(path) as m, pytest.raises(SparkpackError) as e:
        GGUFTokenizer.from_metadata(m)
    assert str(path) in str(e.value) and "'llama'" in str(e.value)


def test_converted_gguf_matches_its_hf_tokenizer(tiny_hf_gguf):
    """End to end: the metadata repack's converter writes rebuilds the HF tokenizer's ids."""
    from tokenizers import Tokenizer

    from sparkpack.formats.gguf_file import GGUFModel

    hf_dir, path = tiny_hf_gguf("qwen3moe")
    hf = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    with GGUFModel(path) as m:
        tok = GGUFTokenizer.from_metadata(m)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
    assert tok.decode(hf.encode(TEXTS[6]).ids, skip_special=True) == hf.decode(hf.encode(TEXTS[6]).ids)


@pytest.mark.parametrize("vocab", ["qwen2", "qwen35"])
def test_real_vocabularies_give_llama_cpps_own_test_ids(vocab, tmp_path):
    """llama.cpp's tokenizer test vectors (``models/ggml-vocab-NAME.gguf.inp`` / ``.out``, what its
    test-tokenizer-0 checks): Qwen2's BPE (Qwen3-30B-A3B's) and the qwen35 pre-tokenizer on real
    vocabularies, every text to the ids llama.cpp expects, edge cases of whitespace, digits,
    accents, emoji and scripts included."""
    from sparkpack.formats.gguf_file import GGUFModel
    from tests.paths import SDIST_HINT, llama_cpp_model_file

    name = f"ggml-vocab-{vocab}.gguf"
    files = [llama_cpp_model_file(name + end) for end in ("", ".inp", ".out")]
    if any(f is None for f in files):
        pytest.skip(SDIST_HINT)
    (tmp_path / name).write_bytes(files[0])
    tok = GGUFTokenizer.from_metadata(GGUFModel(tmp_path / name))
    texts = files[1].decode().split("\n__ggml_vocab_test__\n")
    expected = [[int(t) for t in line.split()] for line in files[2].decode().split("\n")]
    assert len(texts) == len(expected) > 40
    for text, ids in zip(texts, expected):
        assert tok.encode(text) == ids, text
