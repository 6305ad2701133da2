"""Run a MoE model from a GGUF (or a .sparkpack) on CPU or GPU (the `spark-run` command).

\b
  spark-run model.gguf -p "question"        one answer, chat template applied
  spark-run model.gguf -p "text" --raw      plain continuation, no template
  spark-run model.gguf                      interactive chat (keeps the history)
  spark-run model.gguf --prompt-ids 1,2,3 --logits-out l.npy
                                            logits [n_ids, vocab] of exactly those ids
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import click

from formats.errors import SparkpackError, cli_entry
from repack.units import SizeParam

DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")


def open_model(path: Path, device: str, dtype_name: str, expert_cache: int | None = None):
    """Build the runtime model from a .gguf file or a .sparkpack directory."""
    import torch

    from .models import load_model

    if device == "cuda" and not torch.cuda.is_available():
        raise SparkpackError(None, "--device cuda: no CUDA device is available (use --device cpu)")
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device == "cuda" else "float32"
    return load_model(path, device=device, dtype=getattr(torch, dtype_name), expert_cache_bytes=expert_cache)


def load_tokenizer(model):
    from .tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_metadata(model.gguf)


def parse_ids(text: str, n_vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise SparkpackError(None, f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise SparkpackError(None, "--prompt-ids is empty")
    bad = [i for i in ids if not 0 <= i < n_vocab]
    if bad:
        raise SparkpackError(None, f"--prompt-ids: token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    return ids


def save_npy_atomic(path: Path, array) -> None:
    import numpy as np

    path = path.resolve()
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_sampler(temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                 seed: int | None):
    """None (greedy) for temperature 0, else the project's sampler."""
    if temperature <= 0:
        return None
    from .sampling import Sampler

    return Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   repetition_penalty=repeat_penalty, seed=seed)


def stream(model, tok, ids: list[int], sampler, max_tokens: int, session=None) -> list[int]:
    """Generate and print text as it comes; returns the generated ids."""
    from .generate import generate

    out: list[int] = []
    decoder = tok.stream(skip_special=True)  # holds back partial UTF-8 characters
    for t in generate(model, tok, ids, sampler, max_tokens, session=session):
        out.append(t)
        click.echo(decoder.push(t), nl=False)
    click.echo(decoder.flush())
    return out


def chat_template(model, raw: bool) -> str | None:
    if raw:
        return None
    template = model.gguf.get("tokenizer.chat_template")
    if not template:
        raise SparkpackError(model.gguf.path, "has no chat template; use --raw for a plain continuation")
    return template


def chat_ids(tok, template: str, messages: list[dict]) -> list[int]:
    """The rendered conversation's ids; the template writes any BOS itself, so none is added."""
    from .chat_template import ChatTemplate

    text = ChatTemplate.from_tokenizer(template, tok).render(messages, add_generation_prompt=True)
    return tok.encode(text, add_special=False)


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__)
@click.argument("model_path", metavar="MODEL", type=click.Path(path_type=Path))
@click.option("-p", "--prompt", help="Prompt text (chat template applied unless --raw).")
@click.option("--system", help="System message for chat prompts.")
@click.option("--raw", is_flag=True, help="Feed the prompt as plain text, without the chat template.")
@click.option("--prompt-ids", help="Comma-separated token ids fed exactly (no BOS, no template).")
@click.option("--logits-out", type=click.Path(dir_okay=False, path_type=Path),
              help="With --prompt-ids: write float32 logits [n_ids, vocab] to this .npy and exit.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dtype", "dtype_name", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="Compute dtype (auto: float32 on cpu, bfloat16 on cuda).")
@click.option("--expert-cache", type=SizeParam(), default="8GiB", show_default=True,
              help="Memory for dequantized experts (least recently used are re-expanded when needed).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.7, show_default=True,
              help="0 means greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1), default=0.95, show_default=True)
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.05, show_default=True)
@click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed (default: random).")
def run_cmd(model_path: Path, prompt: str | None, system: str | None, raw: bool, prompt_ids: str | None,
            logits_out: Path | None, device: str, dtype_name: str, expert_cache: int, max_tokens: int, temperature: float,
            top_k: int, top_p: float, min_p: float, repeat_penalty: float, seed: int | None) -> None:
    if logits_out is not None and prompt_ids is None:
        raise SparkpackError(None, "--logits-out needs --prompt-ids")
    if prompt_ids is not None and prompt is not None:
        raise SparkpackError(None, "give either -p/--prompt or --prompt-ids, not both")
    model = open_model(model_path, device, dtype_name, expert_cache)
    if prompt_ids is not None:
        ids = parse_ids(prompt_ids, model.spec.n_vocab)
        if logits_out is not None:
            import numpy as np

            logits = model.forward(ids).float().cpu().numpy().astype(np.float32)
            save_npy_atomic(logits_out, logits)
            return
    sampler = make_sampler(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    if prompt_ids is not None:
        stream(model, load_tokenizer(model), ids, sampler, max_tokens)
        return

    tok = load_tokenizer(model)
    if prompt is not None:
        template = chat_template(model, raw)
        if template is None:
            ids = tok.encode(prompt, add_special=True)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
            ids = chat_ids(tok, template, messages)
        stream(model, tok, ids, sampler, max_tokens)
        return
    chat(model, tok, chat_template(model, False), system, sampler, max_tokens)


def chat(model, tok, template: str, system: str | None, sampler, max_tokens: int) -> None:
    """Interactive loop: the conversation is re-rendered each turn and the cache reused for the
    unchanged prefix. Empty line or EOF ends it; /reset clears the history."""
    from .generate import Session

    session = Session(model)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        out = stream(model, tok, chat_ids(tok, template, messages), sampler, max_tokens, session=session)
        messages.append({"role": "assistant", "content": tok.decode(out, skip_special=True)})


def main() -> None:
    cli_entry(run_cmd, "spark-run")


if __name__ == "__main__":
    main()
