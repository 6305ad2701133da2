"""The checkpoint an interrupted calibration resumes from: the replay state, tied to the run.

Written beside the profile (``NAME.checkpoint.json``) every few conversations and on Ctrl-C or
SIGTERM; ``--resume`` continues from it only when the run is the same (model, corpus, window,
call size, token budget, trace), since counts of another run's conversations would be added to
these. Written atomically: a second Ctrl-C while the first one's checkpoint is written leaves the
previous checkpoint, not half of a new one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparkpack.formats.atomic_file import write_atomic
from sparkpack.formats.errors import SparkpackError

from .replay import ReplayState
from .trace import TraceWriter

CHECKPOINT_EVERY = 16  # conversations between checkpoints; each costs one small JSON write


def checkpoint_path(profile_path: Path) -> Path:
    return profile_path.with_name(profile_path.name + ".checkpoint.json")


def save_checkpoint(path: Path, run_key: dict[str, Any], state: ReplayState, trace: TraceWriter | None) -> None:
    """Counts and done conversations; the trace is flushed first so the token count the
    checkpoint records is on disk."""
    if trace is not None:
        trace.flush()
    write_atomic(path, json.dumps({"run": run_key, "state": state.to_json()}))


def load_checkpoint(path: Path, run_key: dict[str, Any], shape: tuple[int, int, int]) -> ReplayState | None:
    """The state saved at ``path`` for this run, None when there is no checkpoint."""
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        if d["run"] != run_key:
            raise SparkpackError(path, "checkpoint is from a different run (model, corpus, --ctx, --prefill-chunk, "
                                       "--max-tokens or --trace differ); delete it or run without --resume")
        return ReplayState.from_json(d["state"], shape)
    except SparkpackError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise SparkpackError(path, "checkpoint is corrupt; delete it or run without --resume") from None
