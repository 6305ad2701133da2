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


class FormatError(SparkpackError):
    """A file is not what it claims to be (truncated, wrong magic, offsets out of range...)."""


class UnsupportedError(SparkpackError):
    """A valid file that this tool cannot handle (unknown architecture, non-MoE model...)."""


def cli_entry(command, prog: str) -> None:
    """Run a click command so that known failures print one line and exit non-zero.

    ``SparkpackError`` carries its own file-and-problem message; disk and permission errors are
    reported by path; Ctrl-C exits 130. Anything else is a bug and keeps its traceback.
    """
    import sys

    import click

    try:
        command.main(prog_name=prog, standalone_mode=False)
    except SparkpackError as e:
        click.echo(f"{prog}: error: {e}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo(f"{prog}: aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:  # bad option or argument: one line, with where to look
        cmd = e.ctx.command_path if e.ctx is not None else prog
        click.echo(f"{prog}: error: {e.format_message()} (see '{cmd} --help')", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        click.echo(f"{prog}: error: {where}{e.strerror or e}", err=True)
        sys.exit(1)
    except SystemExit:
        raise
