"""Run a MoE model from a GGUF (or a .sparkpack) on CPU or GPU (the `spark-run` command).

\b
  spark-run model.gguf -p "question"        one answer, chat template applied
  spark-run model.gguf -p "text" --raw      plain continuation, no template
  spark-run model.gguf --prompt-file p.md   the prompt from a file (long agent prompts)
  spark-run model.gguf                      interactive chat (keeps the history; /help)
  spark-run model.gguf --prompt-ids 1,2,3 --logits-out l.npy
                                            logits [n_ids, vocab] of exactly those ids
  spark-run model.sparkpack --vram 14GiB    fit a 16 GB card: hot experts, cache and KV
                                            sized to the budget, misses read from RAM
  spark-run model.gguf --serve --vram 14GiB --ctx 65536
                                            serve it to coding agents (OpenAI and Anthropic
                                            APIs on 127.0.0.1:8080); prints the client settings

On a GPU the experts live in the tiered store (hot set, cache slots, pinned host memory);
a .sparkpack brings its placement, a .gguf uses MODEL.profile.json when present. With the
store every run learns which experts its traffic uses into MODEL.profile.json (--no-learn:
not), and a server moves the hot set toward them between requests.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sparkpack.formats.atomic_file import write_atomic
from sparkpack.formats.errors import SparkpackError, Terminated, cli_entry
from sparkpack.formats.memory import KV_BYTES_PER_VALUE, PREFILL_CHUNK
from sparkpack.formats.units import SizeParam

from .learn_flags import learning_options
from .options import (DEFAULT_DEQUANT_LIMIT, DEFAULT_DRAFT_TOKENS, DEVICES, DRAFT_KINDS, DTYPES, MAX_DRAFT_TOKENS,
                      MISS_MODES, ONE_SHOT_MAX_TOKENS, RunOptions, SamplingOptions, open_model, open_session,
                      run_options)
from .run_report import report_residency, report_stats


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
    """Under the project's temp name (``formats.atomic_file``), which later commands clear when a
    kill leaves it behind."""
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array)
    write_atomic(path, buf.getvalue())


def one_shot_sampler(sampling: SamplingOptions):
    """None (greedy) for temperature 0, else the project's sampler: spark-run's own runs take
    ``--temperature 0`` as greedy whatever the penalties (the server applies them)."""
    return None if sampling.temperature <= 0 else sampling.sampler(0)


def check_prompt(n_prompt: int, ctx: int, reply: bool = True) -> None:
    """The context (--ctx) holds the prompt and, when one is generated, at least one token of
    the reply; a longer prompt is refused rather than run past the KV cache it was sized for."""
    if n_prompt > ctx or (reply and n_prompt == ctx):
        need = "the prompt and its reply" if reply else "the prompt"
        raise SparkpackError(None, f"the prompt is {n_prompt} tokens and --ctx is {ctx}: the context must hold "
                                   f"{need} (raise --ctx or shorten the prompt)")


def stream(model, tok, ids: list[int], sampler, max_tokens: int, session, ctx: int,
           out: list[int] | None = None) -> list[int]:
    """Generate and print text as it comes, stopping at the end of the context; returns the
    generated ids (``out``, when given, fills as they come: an interrupted reply keeps them)."""
    from .generate import generate

    check_prompt(len(ids), ctx)
    room = ctx - len(ids)
    out = [] if out is None else out
    decoder = tok.decoder(skip_special=True)  # holds back partial UTF-8 characters
    try:
        for t in generate(model, tok, ids, sampler, min(max_tokens, room), session=session):
            out.append(t)
            click.echo(decoder.push(t), nl=False)
    finally:
        click.echo(decoder.flush())
    if len(out) == room < max_tokens:
        click.echo(f"[stopped: the context is full (--ctx {ctx})]", err=True)
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
@click.version_option(package_name="sparkpack", prog_name="spark-run")
@click.argument("model_path", metavar="MODEL", type=click.Path(path_type=Path))
@click.option("-p", "--prompt", help="Prompt text (chat template applied unless --raw).")
@click.option("--system", help="System message for chat prompts.")
@click.option("--raw", is_flag=True, help="Feed the prompt as plain text, without the chat template.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the prompt text from this file (long prompts: one argument is limited by the OS).")
@click.option("--prompt-ids", help="Comma-separated token ids fed exactly (no BOS, no template).")
@click.option("--prompt-ids-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read --prompt-ids from this file (comma- or whitespace-separated).")
@click.option("--logits-out", type=click.Path(dir_okay=False, path_type=Path),
              help="With --prompt-ids: write float32 logits [n_ids, vocab] to this .npy and exit.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="auto: cuda when a GPU is present.")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads for torch [torch's default: one per core].")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="Compute dtype (auto: float32 on cpu, bfloat16 on cuda).")
@click.option("--dequant-limit", type=SizeParam(), default=DEFAULT_DEQUANT_LIMIT, show_default="8GiB",
              help="Without the store (CPU): most memory for dequantized experts (the least recently used are "
                   "dropped and re-expanded when needed).")
@click.option("--vram", type=SizeParam(), help="GPU memory budget: hot experts, cache slots and KV cache sized to fit.")
@click.option("--hot-fraction", type=click.FloatRange(0, 1), help="Share of expert bytes kept on the GPU.")
@click.option("--cache-slots", type=click.IntRange(min=0), help="GPU slots caching cold experts [max(4 x top-k, half of one token's "
              "routings over all MoE layers)].")
@click.option("--profile", type=click.Path(dir_okay=False, path_type=Path),
              help="Routing profile choosing the hot experts [MODEL.profile.json when present].")
@click.option("--miss-mode", type=click.Choice(MISS_MODES), default="auto", show_default=True,
              help="How a cold expert's bytes reach the GPU on a miss (see runtime/expert_store.py).")
@click.option("--host-ram", type=SizeParam(), help="Pinned host memory for cold experts [80% of available]; "
              "less than they need reads misses from disk.")
@click.option("--ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Context the KV cache is allocated for (and --vram reserves); decode steps replay a CUDA graph up to it.")
@click.option("--kv-type", type=click.Choice(list(KV_BYTES_PER_VALUE)), default="auto", show_default=True,
              help="KV cache storage: auto (the activations' dtype, bf16 on a GPU) or q8_0 (about half the memory).")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=PREFILL_CHUNK, show_default=True,
              help="Prompt tokens per forward call: larger prefills faster, for more activation memory (--vram plans "
                   "for it). All-attention models on a GPU in half precision with a 16-bit KV cache (Qwen3 MoE, "
                   "Laguna), whose prompt calls are replayed from CUDA graphs, use at most 512.")
@click.option("--draft", type=click.Choice(DRAFT_KINDS), default="off", show_default=True,
              help="Speculative decoding: draft tokens by prompt lookup (ngram) or with the file's MTP head (mtp), "
                   "verified in one step of the model; greedy output stays token for token the same.")
@click.option("--draft-tokens", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=DEFAULT_DRAFT_TOKENS,
              show_default=True, help="Most tokens drafted per verify step (fewer while drafts are rejected).")
@click.option("--store/--no-store", "use_store", default=None,
              help="Use the tiered expert store [on for cuda or when a store option is given].")
@click.option("--stats-json", type=click.Path(dir_okay=False, path_type=Path),
              help="Write speed, hit and memory statistics of the run to this JSON file.")
@click.option("--max-tokens", type=click.IntRange(min=1),
              help=f"Most tokens to generate [{ONE_SHOT_MAX_TOKENS}]. With --serve: the cap of requests that set "
                   "none (Codex sends none) [the context's end].")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.7, show_default=True,
              help="0 means greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1), default=0.95, show_default=True)
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.05, show_default=True)
@click.option("--repeat-penalty", "repetition_penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed (default: random).")
@click.option("--serve", is_flag=True, help="Serve the model over HTTP (OpenAI and Anthropic APIs) instead of "
              "running a prompt; the sampling options become the requests' defaults.")
@click.option("--host", default="127.0.0.1", show_default=True, help="With --serve: address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="With --serve: port (0 picks a free one).")
@click.option("--api-key", help="With --serve: require this key (Authorization: Bearer or x-api-key).")
@click.option("--api-key-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="With --serve: read the key from this file (keeps it out of the process list).")
@click.option("--cache-ram", type=SizeParam(), help="With --serve: host RAM keeping recent conversations' states to "
              "resume them [8GiB, or half of what is left beside the model if less]; 0 turns it off.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="With --serve: also keep conversations' states in this folder, so that a restarted server "
                   "resumes them.")
@click.option("--parallel", type=click.IntRange(min=1),
              help="With --serve: requests decoded together, one token each per step (each reply the one it "
                   "gets alone), each with its KV cache at --ctx (--vram holds them all); 1 computes one request "
                   "at a time. [4]")
@click.option("--step-tokens", type=click.IntRange(min=0),
              help="With --serve and --parallel 2 or more: prompt tokens prefilled per decode step, so that a long "
                   "prompt is fed in chunks between the running requests' tokens (whole calls: at least one a "
                   "step); 0 prefills a prompt whole while the others wait. [512]")
@learning_options  # --no-learn --force --half-life --generated-weight --profile-save-every --bootstrap --trace-out
def run_cmd(model_path: Path, prompt: str | None, prompt_file: Path | None, system: str | None, raw: bool,
            prompt_ids: str | None, prompt_ids_file: Path | None, logits_out: Path | None, **flags: Any) -> None:
    """The prompt's flags are handled here; every other flag (``flags``) is translated into the
    one ``RunOptions`` the run, the chat and the server read (``run_options``)."""
    prompt = _from_file(prompt, prompt_file, "-p/--prompt", "--prompt-file")
    prompt_ids = _from_file(prompt_ids, prompt_ids_file, "--prompt-ids", "--prompt-ids-file")
    if prompt_ids is not None:
        prompt_ids = ",".join(prompt_ids.replace(",", " ").split())
    if flags["serve"] and (prompt is not None or prompt_ids is not None or raw or system is not None):
        raise SparkpackError(None, "--serve takes its prompts from HTTP requests: drop -p/--prompt-file/--prompt-ids/--raw/--system")
    if logits_out is not None and prompt_ids is None:
        raise SparkpackError(None, "--logits-out needs --prompt-ids")
    if prompt_ids is not None and prompt is not None:
        raise SparkpackError(None, "give either -p/--prompt or --prompt-ids, not both")
    opts = run_options(model_path, **flags)
    with running(opts):
        if opts.serve is not None:
            from .server.serve import serve_from_cli

            serve_from_cli(opts)
            return
        model = open_model(opts)
        if model.store is not None:
            report_residency(model)
        with learning_run(model, opts) as ready:
            session = run_session(model, opts, prompt, system, raw, prompt_ids, logits_out, ready)
    if session is not None:
        report_stats(model, session, opts.stats_json)


@contextlib.contextmanager
def running(opts: RunOptions):
    """A run's process settings: torch's CPU threads set here, in the main thread (the server
    loads and runs in others); a GPU out of memory becomes one line saying what to lower."""
    import torch

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        if os.environ.get("SPARKPACK_DEBUG"):
            raise
        asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(e))
        more = f"needed {asked.group(1)} more " if asked else ""
        raise SparkpackError(opts.model_path, f"the GPU ran out of memory ({more}with "
                                              f"{torch.cuda.memory_reserved() / 1024**3:.2f} GiB reserved): lower "
                                              "--vram's share for experts (--hot-fraction, --cache-slots) or --ctx") from None
def _from_file(value: str | None, path: Path | None, flag: str, file_flag: str) -> str | None:
    """The option's text, or the file's when ``file_flag`` was given instead."""
    if path is None:
        return value
    if value is not None:
        raise SparkpackError(None, f"give either {flag} or {file_flag}, not both")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SparkpackError(path, "is not UTF-8 text") from None


def run_session(model, opts: RunOptions, prompt: str | None, system: str | None, raw: bool,
                prompt_ids: str | None, logits_out: Path | None, ready: Callable[[], None] = lambda: None):
    """The run itself; returns the generation session (for statistics) or None. ``ready()`` is
    called once the warm-up is done and the real tokens follow."""
    tok = load_tokenizer(model)
    session = open_session(model, opts.session, tok.control_ids, opts.draft)
    sampler = one_shot_sampler(opts.sampling)
    if model.device.type == "cuda" and logits_out is None:  # kernels and graphs ready before the prompt
        click.echo(f"warmed up in {session.warm_up():.2f} s", err=True)
    ready()
    if prompt_ids is not None:
        ids = parse_ids(prompt_ids, model.spec.n_vocab)
        if logits_out is not None:
            import numpy as np

            check_prompt(len(ids), opts.session.ctx, reply=False)
            kv = model.new_cache(kv_type=opts.session.kv_type)
            logits = model.forward(ids, kv).float().cpu().numpy().astype(np.float32)
            save_npy_atomic(logits_out, logits)
            return None
        stream(model, tok, ids, sampler, opts.reply_tokens, session, opts.session.ctx)
        return session

    if prompt is not None:
        template = chat_template(model, raw)
        if template is None:
            ids = tok.encode(prompt, add_special=True)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
            ids = chat_ids(tok, template, messages)
        stream(model, tok, ids, sampler, opts.reply_tokens, session, opts.session.ctx)
        return session
    chat(model, tok, chat_template(model, False), system, sampler, opts.reply_tokens, session, opts.session.ctx)
    return session


@contextlib.contextmanager
def learning_run(model, opts: RunOptions):
    """A one-shot run (prompt, chat, logits) that learns: the trace is attached before any CUDA
    graph is captured, the learner once the warm-up is over (the ``ready`` this yields); however
    the run ends (normally, an error, Ctrl-C, SIGTERM) the profile is written and the trace sealed."""
    from .learning import LiveLearning, start_learning
    from .routing_trace import attach_trace

    trace_out = opts.learning.trace_out
    trace = attach_trace(model, trace_out) if trace_out is not None else None
    learner: list[LiveLearning] = []
    new = model.start_profile is not None and model.start_profile.file is not None \
        and not model.start_profile.file.path.exists()

    def ready() -> None:
        if trace is not None:
            trace.active = True
        started = (start_learning(model, opts.store.learn, opts.store.generated_weight) if opts.store is not None
                   else None)
        if started is not None:
            if model.start_profile.profile is not None:
                started.replace_all()  # a pack's placement moves to where the profile says
            learner.append(started)

    try:
        yield ready
    finally:
        for done in learner:
            if not done.close():
                click.echo(f"warning: could not write the profile {done.file.path}", err=True)
            elif new:  # a file appears beside the model: say what it is, once
                click.echo(f"learned placement saved to {done.file.path} (the next run places experts from it; "
                           "--no-learn: not)", err=True)
        if trace is not None:
            click.echo(f"trace: {trace.close()} ({trace.tokens} tokens)", err=True)


CHAT_HELP = """\
commands (not sent to the model):
  /reset        forget the conversation (the system message stays)
  /system TEXT  set the system message (/system alone removes it)
  /help         this list
  /exit         end the chat (or Ctrl-D, or Ctrl-C at the prompt)
Ctrl-C during a reply stops that reply; the conversation goes on. Arrow keys edit and recall lines."""


def chat(model, tok, template: str, system: str | None, sampler, max_tokens: int, session, ctx: int) -> None:
    """Interactive loop: the conversation is re-rendered each turn and the cache reused for the
    unchanged prefix. Lines starting with ``/`` are commands, handled here (CHAT_HELP)."""
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 - gives input() line editing and a history (arrow keys)

        click.echo(CHAT_HELP, err=True)
    history: list[dict] = []
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        except KeyboardInterrupt as e:  # Ctrl-C at the prompt ends the chat; SIGTERM ends the program
            if isinstance(e, Terminated):
                raise
            click.echo("", err=True)
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/exit", "/quit"):
                return
            if cmd == "/reset":
                history = []
                click.echo("[conversation cleared]", err=True)
            elif cmd == "/system":
                system = arg.strip() or None
                click.echo(f"[system message {'set' if system else 'removed'}]", err=True)
            elif cmd == "/help":
                click.echo(CHAT_HELP, err=True)
            else:
                click.echo(f"[unknown command {cmd}; /help lists them]", err=True)
            continue
        turn = [{"role": "user", "content": line}]
        messages = ([{"role": "system", "content": system}] if system else []) + history + turn
        out: list[int] = []
        try:
            stream(model, tok, chat_ids(tok, template, messages), sampler, max_tokens, session, ctx, out)
        except SparkpackError as e:  # a conversation grown past --ctx: say so, keep the chat
            click.echo(f"error: {e}; /reset to start over", err=True)
            continue
        except KeyboardInterrupt as e:
            if isinstance(e, Terminated):
                raise
            # Stopped mid-step, the cache may hold part of a chunk: the next turn starts afresh.
            session.reset()
            click.echo("[reply stopped]", err=True)
        history += turn + [{"role": "assistant", "content": tok.decode(out, skip_special=True)}]


def main() -> None:
    cli_entry(run_cmd, "spark-run")


if __name__ == "__main__":
    main()
