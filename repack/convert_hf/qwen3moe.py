"""``Qwen3MoeForCausalLM`` -> GGUF ``qwen3moe`` (Qwen3-30B-A3B family).

No value transforms: q/k projections keep HF row order (NEOX rope on both sides), norms are stored
as their weights, experts are stacked into 3-D tensors. Metadata is the shared decoder set plus
the expert FFN width.
"""
from __future__ import annotations

from typing import Any

from .common import Arch, write_common_metadata


def write_metadata(w, hp: dict[str, Any], outtype: str) -> None:
    write_common_metadata(w, hp, outtype)
    if (n := hp.get("moe_intermediate_size")) is not None:
        w.add_expert_feed_forward_length(int(n))
    if (n := hp.get("shared_expert_intermediate_size")) is not None:
        w.add_expert_shared_feed_forward_length(int(n))


ARCH = Arch(hf_class="Qwen3MoeForCausalLM", gguf_arch="qwen3moe", tokenizer_pre="qwen2",
            write_metadata=write_metadata)
