"""spark-run's placement-learning options, one block: ``learning_options`` adds them to a click
command and hands the command one ``LearningFlags`` (``learning=``) instead of eight arguments.

What they drive: ``runtime.learning`` (learn, save, re-place), ``runtime.server.bootstrap``
(``--bootstrap``) and ``runtime.routing_trace`` (``--trace-out``); README, "Gets faster the more
you use it", has an example of each.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from sparkpack.formats.decayed_routing import HALF_LIFE_TOKENS
from sparkpack.formats.errors import SparkpackError
from sparkpack.formats.placement import GEN_WEIGHT
from sparkpack.formats.profile_file import SAVE_EVERY_S

from .learning import LearnOptions


@dataclass(frozen=True)
class LearningFlags:
    learn: LearnOptions | None = LearnOptions()  # None: --no-learn
    gen_weight: float = GEN_WEIGHT
    bootstrap: str | None = None  # a path, or "auto"
    bootstrap_background: bool = False
    trace_out: Path | None = None

    @property
    def needs_store(self) -> bool:
        """Options that only the expert store can serve (it sees the routings)."""
        return self.bootstrap is not None or self.trace_out is not None

    def check(self, serve: bool) -> None:
        """Combinations that cannot work, as one line each."""
        if self.bootstrap is not None and not serve:
            raise SparkpackError(None, "--bootstrap replays past sessions before serving: it needs --serve")
        if self.bootstrap is not None and self.learn is None:
            raise SparkpackError(None, "--bootstrap teaches the placement: it cannot be combined with --no-learn")
        if self.bootstrap_background and self.bootstrap is None:
            raise SparkpackError(None, "--bootstrap-background needs --bootstrap PATH|auto")


_OPTIONS = [
    click.option("--no-learn", is_flag=True, help="Do not learn the placement from this run's traffic (the profile "
                 "is read, never written, and the hot set does not move)."),
    click.option("--force", is_flag=True, help="Learn into --profile / MODEL.profile.json even when it holds "
                 "another model's profile or no profile at all (it is replaced; refused otherwise)."),
    click.option("--half-life", type=click.FloatRange(min=1), default=HALF_LIFE_TOKENS, show_default=True,
                 help="Tokens after which a learned routing counts half: shorter follows a change of work "
                 "sooner, longer averages more traffic."),
    click.option("--generated-weight", type=click.FloatRange(0, 1), default=GEN_WEIGHT, show_default=True,
                 help="Weight of generated-side routings when placing experts (a miss while decoding stalls a "
                 "token; the prompt side gets the rest)."),
    click.option("--profile-save-every", type=click.FloatRange(min=0), default=SAVE_EVERY_S, show_default=True,
                 help="Seconds between profile writes after requests (0: after every request); it is also "
                 "written at exit and on SIGTERM."),
    click.option("--bootstrap", metavar="PATH|auto", help="With --serve: learn from past agent sessions before "
                 "serving: auto reads Claude Code's and Codex's logs in your home (locally), PATH a file or folder "
                 "of conversations."),
    click.option("--bootstrap-background", is_flag=True, help="Serve at once and bootstrap while idle."),
    click.option("--trace-out", type=click.Path(dir_okay=False, path_type=Path),
                 help="Record every token's routed experts to this trace (for repack calibrate --eval)."),
]


def learning_flags(no_learn: bool = False, force: bool = False, half_life: float = HALF_LIFE_TOKENS,
                   generated_weight: float = GEN_WEIGHT, profile_save_every: float = SAVE_EVERY_S,
                   bootstrap: str | None = None, bootstrap_background: bool = False,
                   trace_out: Path | None = None) -> LearningFlags:
    """The options' values (click's parameter names) as one ``LearningFlags``."""
    learn = None if no_learn else LearnOptions(half_life, profile_save_every, force)
    return LearningFlags(learn, generated_weight, bootstrap, bootstrap_background, trace_out)


FLAG_NAMES = ("no_learn", "force", "half_life", "generated_weight", "profile_save_every", "bootstrap",
              "bootstrap_background", "trace_out")


def learning_options(command: Callable) -> Callable:
    """Adds the options to ``command``, which receives them as ``learning: LearningFlags``."""
    @functools.wraps(command)
    def with_flags(*args, **kwargs):
        flags = learning_flags(**{name: kwargs.pop(name) for name in FLAG_NAMES})
        return command(*args, learning=flags, **kwargs)

    for option in reversed(_OPTIONS):
        with_flags = option(with_flags)
    return with_flags
