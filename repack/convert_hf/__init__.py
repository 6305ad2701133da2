"""Convert a transformers MoE checkpoint to the GGUF llama.cpp's convert_hf_to_gguf.py would write.

Tiny random models converted this way are the outside referee of the runtime: llama.cpp's own
conversion of these classes gives logits equal to transformers, so matching its tensor names,
layouts, value transforms and metadata exactly makes our GGUF a faithful stand-in for the HF
model. One module per transformers class holds that class's mapping; ``common`` does the rest.
"""
from __future__ import annotations

from pathlib import Path

from sparkpack.formats.errors import SparkpackError, UnsupportedError

from . import laguna, qwen3moe, qwen35moe
from .common import OUTTYPES, Arch, encode, gguf_tensors, output_qtype, write_gguf
from .source import SafetensorsSource, load_config
from .vocab import add_tokenizer

ARCHS: dict[str, Arch] = {a.hf_class: a for a in (qwen3moe.ARCH, qwen35moe.ARCH, laguna.ARCH)}
# The multimodal wrapper of Qwen3.5/3.6 holds the same text model.
ARCHS["Qwen3_5MoeForConditionalGeneration"] = qwen35moe.ARCH


def arch_for(hf_dir: Path, config: dict) -> Arch:
    classes = config.get("architectures") or []
    for c in classes:
        if c in ARCHS:
            return ARCHS[c]
    raise UnsupportedError(hf_dir / "config.json",
                           f"architecture {', '.join(map(str, classes)) or '(none)'} is not supported "
                           f"(supported: {', '.join(sorted(ARCHS))})")


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Write ``out`` (atomically) from the checkpoint in ``hf_dir``; returns ``out``."""
    hf_dir, out = Path(hf_dir), Path(out)
    if outtype not in OUTTYPES:
        raise SparkpackError(None, f"unknown output type {outtype!r} (choose from {', '.join(OUTTYPES)})")
    config = load_config(hf_dir)
    arch = arch_for(hf_dir, config)
    source = SafetensorsSource(hf_dir)

    def fill(w) -> None:
        import gguf

        w.add_type("model")
        w.add_name(hf_dir.resolve().name)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        arch.write_metadata(w, config, outtype)
        add_tokenizer(w, hf_dir, config.get("vocab_size"), arch.tokenizer_pre, arch.control_tokens)
        for name, data in gguf_tensors(arch, source, config):
            qtype = output_qtype(name, data, outtype)
            encoded = encode(data, qtype)
            w.add_tensor(name, encoded, raw_dtype=qtype)

    return write_gguf(out, arch, fill)
