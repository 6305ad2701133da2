"""The product's server with test hooks injected: forced replies, a failure on request, and each
request's prompt logits and token ids dumped to a folder. No flag of ``spark-run`` does this.

In process, ``ForcedReplies(folder).hooks`` goes to ``build_served(..., hooks=)``; as a process,
``python tests/hooked_server.py FOLDER MODEL [spark-run's options]`` serves as ``spark-run MODEL
--serve [options]`` does (``tests/serve_proc.ServerProcess(hooks=...)`` starts it, and so does
``bench/agents_check.py``, whose proxy scripts the real agents' replies through ``FORCED``).

A request's body may carry, beside the API's own fields:

- ``FORCED`` (text): the engine teacher-forces its tokens and then the template's end of turn;
  the model still runs every step on them, only the choice of each token is overridden, so a
  tiny random model drives the real tool-call and reasoning paths with a known text;
- ``FAIL`` (text): raised in the engine thread after the prefill (the internal-error path).

Per computed request N (from 1) the folder receives ``N.npy``, the last prompt token's logits (to
compare with a fresh run bit for bit), and ``N.json``, its prompt and generated token ids. With
``--profile-save-every 0`` the learned profile is also rewritten whenever the server is idle
(a ``kill -9`` then lands in the middle of a write).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORCED = "sparkpack_test_output"
FAIL = "sparkpack_test_fail"


class ForcedTokens:
    """A sampler that returns ``tokens`` in order, then ``stop``."""

    history_free = False

    def __init__(self, tokens: list[int], stop: int):
        self.tokens, self.stop = list(tokens), stop

    def sample(self, logits, history: list[int]) -> int:
        return self.tokens.pop(0) if self.tokens else self.stop


class ForcedReplies:
    """The hooks, writing into ``folder``."""

    def __init__(self, folder: Path, save_when_idle: bool = False):
        from sparkpack.runtime.server.serve import ServeHooks

        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.save_when_idle = save_when_idle
        self.tokenizer: Any = None
        self.computed = 0
        self.hooks = ServeHooks(sampler=self.sampler, after_prefill=self.after_prefill, loaded=self.loaded)

    def loaded(self, served) -> None:
        self.tokenizer = served.tokenizer
        if served.learning is not None and self.save_when_idle:
            served.learning.save_when_idle = True

    def sampler(self, job):
        from sparkpack.runtime.server.engine import own_sampler

        forced = job.extra.get(FORCED)
        if isinstance(forced, str):
            return ForcedTokens(self.tokenizer.encode(forced, add_special=False), self.tokenizer.end_of_turn)
        return own_sampler(job)

    def after_prefill(self, job, logits) -> None:
        import numpy as np

        self.computed += 1
        np.save(self.folder / f"{self.computed}.npy", logits.float().cpu().numpy())
        if isinstance(job.extra.get(FAIL), str):
            raise RuntimeError(job.extra[FAIL])
        job.sink = DumpAtEnd(job, self.folder / f"{self.computed}.json")


class DumpAtEnd:
    """A job's sink that writes the job's prompt and generated ids to ``path`` before the
    response ends (a client that got its answer finds them there), unless generation failed."""

    def __init__(self, job, path: Path):
        self.prompt, self.path, self.inner = job.ids, path, job.sink
        self.tokens: list[int] = []

    def started(self, outcome) -> None:
        self.inner.started(outcome)

    def token(self, token_id: int) -> bool:
        self.tokens.append(token_id)
        return self.inner.token(token_id)

    def end(self, outcome) -> None:
        if outcome.finish != "error":
            self.path.write_text(json.dumps({"prompt": self.prompt, "tokens": self.tokens}))
        self.inner.end(outcome)


def main() -> None:
    """``FOLDER MODEL [options]``: spark-run's --serve with the hooks writing into FOLDER."""
    import click

    from sparkpack.formats.errors import cli_entry
    from sparkpack.runtime.cli import run_cmd, running
    from sparkpack.runtime.options import run_options
    from sparkpack.runtime.server.serve import serve_from_cli

    prompt_only = {"prompt", "prompt_file", "system", "raw", "prompt_ids", "prompt_ids_file", "logits_out", "serve"}

    def serve(folder: Path, model_path: Path, **flags) -> None:
        opts = run_options(model_path, serve=True, **flags)
        replies = ForcedReplies(folder, save_when_idle=flags["profile_save_every"] == 0)
        with running(opts):
            serve_from_cli(opts, replies.hooks)

    params = [click.Argument(["folder"], type=click.Path(file_okay=False, path_type=Path)),
              *(p for p in run_cmd.params if p.name not in prompt_only)]
    cli_entry(click.Command("hooked_server", params=params, callback=serve), "spark-run")


if __name__ == "__main__":
    main()
