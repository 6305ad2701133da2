"""The product's commands run in-process through their real entry points, as the tests drive them."""
from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner


def run_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """Run spark-run in-process through its real entry point (cli_entry, one-line errors).

    On the CPU unless the test names a device: the references are the CPU float32 model, also
    when the suite runs on a GPU (the GPU runs have their own tests)."""
    from sparkpack.runtime import cli

    if "--device" not in args:
        args = [*args, "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", ["spark-run", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_repack(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """The real ``repack`` entry point in-process: (exit code, stdout, stderr)."""
    from sparkpack.repack.cli import main

    monkeypatch.setattr(sys, "argv", ["repack", *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def calibrate_in_process(*args: str) -> str:
    """``repack calibrate ARGS --quiet`` in-process (fast: torch is already imported); fails the
    test on any error; returns its stdout."""
    from sparkpack.repack.calibrate_cmd import calibrate_cmd

    res = CliRunner().invoke(calibrate_cmd, [*map(str, args), "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout  # (on a GPU, stderr also says where the experts sit and how long the warm-up took)


def drafted_stats(base: list[str], drafter: str, k: int, stats: Path, monkeypatch, capsys) -> dict:
    """``spark-run BASE`` and ``spark-run BASE --draft DRAFTER --draft-tokens K``: the drafted
    reply must be the plain one; returns the drafted run's ``draft`` stats (``--stats-json``)."""
    import json

    code, plain, err = run_cli(base, monkeypatch, capsys)
    assert code == 0, err
    code, got, err = run_cli([*base, "--draft", drafter, "--draft-tokens", str(k), "--stats-json", str(stats)],
                             monkeypatch, capsys)
    assert code == 0, err
    assert got == plain
    return json.loads(stats.read_text())["draft"]
