"""spark-run's placement-learning options, one block: ``learning_options`` adds them to a click
command; ``runtime.options.run_options`` translates their values with every other flag's.

What they drive: ``runtime.learning`` (learn, save, re-place), ``runtime.server.bootstrap``
(``--bootstrap``) and ``runtime.routing_trace`` (``--trace-out``); README, "Gets faster the more
you use it", has an example of each.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from sparkpack.formats.decayed_routing import HALF_LIFE_TOKENS
from sparkpack.formats.placement import GEN_WEIGHT
from sparkpack.formats.profile_file import SAVE_EVERY_S

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


def learning_options(command: Callable) -> Callable:
    """Adds the options to ``command`` (they arrive as keyword arguments named as click names them)."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command
