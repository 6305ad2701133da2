"""The one error type that crosses module boundaries.

Every command turns a ``SparkpackError`` into a single line on stderr and a non-zero exit, so the
message must name the file (or other input) and the problem in words a user can act on.
"""
from __future__ import annotations

import os


class SparkpackError(Exception):
    """A user-facing failure: bad input, a budget that cannot be met, a corrupt file."""

    def __init__(self, where: str | os.PathLike[str] | None, problem: str):
        self.where = os.fspath(where) if where is not None else None
        self.problem = problem
        super().__init__(f"{self.where}: {problem}" if self.where else problem)


def shown(text: str, limit: int = 80) -> str:
    """``text`` from a file (a metadata key, a tensor name) as it may appear in a message: control
    characters escaped and at most ``limit`` characters, so a hostile name cannot break the one
    line a command prints or make it megabytes long."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return out if len(text) <= limit and len(out) <= limit else out[:limit] + "..."


class FormatError(SparkpackError):
    """A file is not what it claims to be (truncated, wrong magic, offsets out of range...)."""


class UnsupportedError(SparkpackError):
    """A valid file that this tool cannot handle (unknown architecture, non-MoE model...)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``timeout``, ``docker stop``, systemd and CI send), raised in the main thread.

    A ``KeyboardInterrupt`` so that every command cleans up its temp outputs and checkpoints
    exactly as it does on Ctrl-C, with no second code path to forget; the exit status still
    tells the two apart."""


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


def _raise_terminated(signum, frame) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise Terminated()


def stop_message(prog: str, stop: KeyboardInterrupt) -> tuple[str, int]:
    """The one line and exit status of an interrupted command; notes added to the exception on
    the way out (``add_note``: where a checkpoint went) are appended."""
    what = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
    notes = "; ".join(getattr(stop, "__notes__", ()))
    return f"{prog}: {what}" + (f": {notes}" if notes else ""), (
        EXIT_TERMINATED if isinstance(stop, Terminated) else EXIT_INTERRUPTED)


def cli_entry(command, prog: str) -> None:
    """Run a click command so that known failures print one line and exit non-zero.

    ``SparkpackError`` carries its own file-and-problem message; disk and permission errors are
    reported by path; Ctrl-C exits 130 and SIGTERM, turned into ``Terminated`` here for every
    command at once, 143. A group called without a command prints its help and exits 0.
    Anything else is a bug and keeps its traceback.
    """
    import signal
    import sys

    import click

    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        command.main(prog_name=prog, standalone_mode=False)
    except SparkpackError as e:
        click.echo(f"{prog}: error: {shown(str(e), 2000)}", err=True)
        sys.exit(1)
    except click.exceptions.NoArgsIsHelpError as e:  # bare `repack`: asking for help is no error
        click.echo(e.ctx.get_help() if e.ctx is not None else command.get_help(click.Context(command)))
        sys.exit(0)
    except click.exceptions.Abort as e:  # click wraps Ctrl-C (and our SIGTERM) in Abort
        stop = e.__cause__ if isinstance(e.__cause__, KeyboardInterrupt) else KeyboardInterrupt()
        line, code = stop_message(prog, stop)
        click.echo(line, err=True)
        sys.exit(code)
    except click.UsageError as e:  # bad option or argument: one line, with where to look
        cmd = e.ctx.command_path if e.ctx is not None else prog
        click.echo(f"{prog}: error: {e.format_message()} (see '{cmd} --help')", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:  # outside click's main (while it parses arguments)
        line, code = stop_message(prog, e)
        click.echo(line, err=True)
        sys.exit(code)
    except BrokenPipeError:
        sys.exit(1)
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        click.echo(f"{prog}: error: {where}{e.strerror or e}", err=True)
        sys.exit(1)
    except SystemExit:
        raise
