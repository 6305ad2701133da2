"""Tiny random transformers models of the supported MoE families, built offline.

They are the outside referee of the whole project: the converter turns them into GGUF files and the
runtime's logits are compared against transformers' own forward pass on the same weights. So the
configs are small enough for CPU tests yet keep every feature that is easy to get wrong switched on
(several experts with top-2 routing, GQA, q/k norms, partial rotary, sliding windows, per-layer
head counts, linear-attention layers, shared experts, a dense leading layer).

Weights are drawn with a std well above the HF default (0.02) so that routing is not a coin toss
and attention patterns are not uniform: with std 0.02 and hidden 64 every router logit is ~0 and a
wrong expert order would go unnoticed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHS = ("qwen3moe", "qwen35moe", "laguna")

# Text the BPE merges are learned from: a little English, code and chat markup so that common
# pieces ("the", " in", "def") become tokens and the tokenizer is not just bytes.
_TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "def main():\n    print('hello world')\n    return 0\n",
    "user: what is the capital of France?\nassistant: The capital of France is Paris.",
    "Experts route tokens; the router picks the top experts for every token in the batch.",
    "for i in range(10):\n    total += i * i\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ! ? : ; ( ) [ ] { }",
] * 4

# Family chat formats. Qwen uses ChatML; Laguna (poolside) uses XML-like role tags and ends an
# assistant turn with </assistant>.
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LAGUNA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>\\n' + message['content'] + '</' + message['role'] + '>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>\\n' }}{% endif %}"
)

_FAMILY_TOKENS: dict[str, dict[str, Any]] = {
    # specials in id order (appended after the BPE vocab); which of them is bos/eos/pad.
    "qwen": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
        "template": _CHATML_TEMPLATE,
    },
    "laguna": {
        "specials": ["<|endoftext|>", "<system>", "</system>", "<user>", "</user>", "<assistant>", "</assistant>"],
        "bos": "<|endoftext|>", "eos": "<|endoftext|>", "pad": "<|endoftext|>",
        "template": _LAGUNA_TEMPLATE,
    },
}


def _family(arch: str) -> str:
    return "laguna" if arch == "laguna" else "qwen"


def build_tokenizer(arch: str, out_dir: Path, bpe_vocab: int = 300) -> dict[str, int]:
    """Train a byte-level BPE on a fixed text, save tokenizer.json + tokenizer_config.json.

    Returns the ids of the special tokens. Deterministic: the same arch gives the same files.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    fam = _FAMILY_TOKENS[_family(arch)]
    tok = Tokenizer(models.BPE())
    # Qwen2-style split regex followed by the byte-level mapping, as the real tokenizers do.
    split = Regex(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split, behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False, special_tokens=[],
    )
    tok.train_from_iterator(_TRAIN_TEXT, trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in fam["specials"]])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))

    ids = {s: tok.token_to_id(s) for s in fam["specials"]}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast" if arch == "laguna" else "Qwen2Tokenizer",
        "model_max_length": 4096,
        "bos_token": fam["bos"],
        "eos_token": fam["eos"],
        "pad_token": fam["pad"],
        "unk_token": None,
        "add_bos_token": fam["bos"] is not None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "chat_template": fam["template"],
        "added_tokens_decoder": {
            str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for s in fam["specials"]
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return ids


def _config(arch: str, vocab_size: int, special: dict[str, int], overrides: dict[str, Any]):
    """The transformers config of one tiny model (validated by transformers' own checks)."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.1,
    )
    if arch == "qwen3moe":
        from transformers import Qwen3MoeConfig

        kw = dict(common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  bos_token_id=None, eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"])
        kw.update(overrides)
        return Qwen3MoeConfig(**kw), "Qwen3MoeForCausalLM"
    if arch == "qwen35moe":
        from transformers import Qwen3_5MoeTextConfig

        n_layer = overrides.pop("num_hidden_layers", 4)
        interval = overrides.pop("full_attention_interval", 4)
        kw = dict(common, num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_num_key_heads=2, linear_num_value_heads=4, shared_expert_intermediate_size=32,
                  layer_types=["linear_attention" if (i + 1) % interval else "full_attention"
                               for i in range(n_layer)],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [1, 1, 0], "mrope_interleaved": True},
                  bos_token_id=None, eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"])
        kw.update(overrides)
        return Qwen3_5MoeTextConfig(**kw), "Qwen3_5MoeForCausalLM"
    if arch == "laguna":
        from transformers import LagunaConfig

        n_layer = overrides.pop("num_hidden_layers", 4)
        kw = dict(common, num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_attention_heads_per_layer=[2 if i % 4 == 0 else 4 for i in range(n_layer)],
                  intermediate_size=96, shared_expert_intermediate_size=32, sliding_window=8,
                  layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n_layer)],
                  mlp_layer_types=["dense"] + ["sparse"] * (n_layer - 1), gating=True,
                  moe_routed_scaling_factor=2.5,
                  rope_parameters={
                      "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 1.0},
                  },
                  bos_token_id=special["<|endoftext|>"],
                  eos_token_id=[special["<|endoftext|>"], special["</assistant>"]],
                  pad_token_id=special["<|endoftext|>"])
        kw.update(overrides)
        return LagunaConfig(**kw), "LagunaForCausalLM"
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")


def _randomize(model, seed: int, std: float) -> None:
    """Redraw every parameter: normal(0, std) for matrices, near-1 for norm weights, and the
    special per-head parameters of DeltaNet (A_log, dt_bias) in their meaningful ranges."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 4.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.75)
            elif "norm" in name and p.dim() == 1:
                # Qwen3.5 stores (1 + w) norms as w; a spread around the stored default keeps them non-trivial.
                base = 0.0 if float(p.mean()) == 0.0 else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def make_tiny_hf(arch: str, out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Build, randomise and save a tiny model of ``arch`` ("qwen3moe", "qwen35moe", "laguna").

    ``overrides`` go into the transformers config (e.g. ``num_hidden_layers=8``). The directory gets
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json and the chat template;
    nothing is downloaded. ``std`` (an override popped here) sets the weight scale (default 0.15).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
    out_dir = Path(out_dir)
    overrides = dict(overrides)
    std = float(overrides.pop("std", 0.15))
    special = build_tokenizer(arch, out_dir)
    n_tok = max(special.values()) + 1
    vocab_size = int(overrides.pop("vocab_size", ((n_tok + 63) // 64) * 64))
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tok} tokens")
    config, cls_name = _config(arch, vocab_size, special, overrides)
    config.architectures = [cls_name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, std)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_tiny_hf(out_dir: Path):
    """Load a model saved by ``make_tiny_hf`` in float32, eval mode (the reference forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(out_dir), dtype=torch.float32)
    return model.eval()


def tokenizer_metadata(hf_dir, pre: str) -> dict:
    """The GGUF tokenizer metadata of an HF tokenizer folder (vocabulary, merges, special ids),
    with pre-tokenizer ``pre``: what ``GGUFTokenizer.from_metadata`` reads."""
    import json

    from sparkpack.repack.convert_hf.vocab import read_vocab

    tokens, types = read_vocab(hf_dir, None)
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    merges = [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    md = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index(cfg["eos_token"]),
    }
    if cfg.get("bos_token"):
        md["tokenizer.ggml.bos_token_id"] = tokens.index(cfg["bos_token"])
        md["tokenizer.ggml.add_bos_token"] = True
    return md
