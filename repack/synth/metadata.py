"""GGUF metadata of a synthetic model: the keys llama.cpp's converter writes for each arch and
llama.cpp reads back (``load_arch_hparams``), plus a working tokenizer and chat template."""
from __future__ import annotations

from importlib import resources

import gguf

from sparkpack.formats.quant_mix import FILE_TYPE

from .presets import Preset
from .vocab import build_vocab

TEMPLATES = {"qwen35moe": "qwen_chat.jinja", "qwen3moe": "qwen_chat.jinja", "laguna": "laguna_chat.jinja"}
PRE_TOKENIZER = {"qwen35moe": "qwen35", "qwen3moe": "qwen2", "laguna": "laguna"}


def chat_template(arch: str) -> str:
    return resources.files(__package__).joinpath(TEMPLATES[arch]).read_text(encoding="utf-8")


def add_metadata(w: gguf.GGUFWriter, p: Preset, mix: str, skew: float, seed: int, file_type: int | None = None,
                 n_mtp: int = 0) -> None:
    """``file_type``: a real file's (``--types-of``) instead of the mix's; ``n_mtp``: MTP blocks after
    the trunk, counted in ``block_count`` and named by ``nextn_predict_layers`` as the converter
    writes them."""
    a = p.arch

    def key(suffix: str) -> str:
        return f"{a}.{suffix}"

    w.add_type("model")
    w.add_name(p.display_name)
    w.add_uint32("general.file_type", FILE_TYPE[mix] if file_type is None else file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # provenance, so nobody mistakes the file for a real model
    w.add_string("sparkpack.synthetic", f"preset={p.name} quant={mix} seed={seed} skew={skew:g}"
                 + (" mtp" if n_mtp else ""))
    w.add_uint32(key("block_count"), p.n_layer + n_mtp)
    if n_mtp:
        w.add_uint32(key("nextn_predict_layers"), n_mtp)
    w.add_uint32(key("context_length"), p.n_ctx)
    w.add_uint32(key("embedding_length"), p.n_embd)
    if p.n_ff_dense:
        w.add_uint32(key("feed_forward_length"), p.n_ff_dense)
    if len(set(p.n_head)) > 1:
        w.add_array(key("attention.head_count"), list(p.n_head))
    else:
        w.add_uint32(key("attention.head_count"), p.n_head[0])
    w.add_uint32(key("attention.head_count_kv"), p.n_head_kv)
    w.add_float32(key("rope.freq_base"), p.rope_base)
    w.add_float32(key("attention.layer_norm_rms_epsilon"), p.rms_eps)
    w.add_uint32(key("expert_count"), p.n_expert)
    w.add_uint32(key("expert_used_count"), p.n_expert_used)
    w.add_uint32(key("attention.key_length"), p.head_dim)
    w.add_uint32(key("attention.value_length"), p.head_dim)
    w.add_uint32(key("expert_feed_forward_length"), p.n_ff_exp)
    if p.n_ff_shexp:
        w.add_uint32(key("expert_shared_feed_forward_length"), p.n_ff_shexp)
    x = p.extra
    if a == "qwen35moe":
        w.add_uint32(key("ssm.conv_kernel"), x["ssm_conv_kernel"])
        w.add_uint32(key("ssm.state_size"), x["ssm_state_size"])
        w.add_uint32(key("ssm.group_count"), x["ssm_group_count"])
        w.add_uint32(key("ssm.time_step_rank"), x["ssm_time_step_rank"])
        w.add_uint32(key("ssm.inner_size"), x["ssm_state_size"] * x["ssm_time_step_rank"])
        w.add_uint32(key("full_attention_interval"), x["full_attention_interval"])
        w.add_uint32(key("rope.dimension_count"), p.rope_dim)
        w.add_array(key("rope.dimension_sections"), list(x["rope_sections"]))
    elif a == "laguna":
        w.add_uint32(key("vocab_size"), p.n_vocab)
        w.add_uint32(key("attention.sliding_window"), x["sliding_window"])
        w.add_bool(key("expert_weights_norm"), True)
        w.add_float32(key("expert_weights_scale"), x["expert_weights_scale"])
        w.add_uint32(key("expert_gating_func"), 2)  # sigmoid
        w.add_uint32(key("leading_dense_block_count"), x["leading_dense"])
        w.add_uint32(key("rope.dimension_count"), p.rope_dim)
        w.add_uint32(key("rope.dimension_count_swa"), x["rope_dim_swa"])
        w.add_float32(key("rope.freq_base_swa"), x["rope_base_swa"])
    add_tokenizer(w, p)


def add_tokenizer(w: gguf.GGUFWriter, p: Preset) -> None:
    family = "laguna" if p.arch == "laguna" else "qwen"
    v = build_vocab(family, p.n_vocab, p.special_start, PRE_TOKENIZER[p.arch])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.token_types)
    w.add_token_merges(v.merges)
    w.add_bos_token_id(v.bos_id)
    w.add_eos_token_id(v.eos_id)
    w.add_eot_token_id(v.eot_id)
    w.add_pad_token_id(v.pad_id)
    w.add_add_bos_token(v.add_bos)
    w.add_chat_template(chat_template(p.arch))
