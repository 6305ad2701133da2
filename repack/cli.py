"""Entry point of ``repack``. Each subcommand lives in its own module and registers here."""
from __future__ import annotations

import difflib
import importlib

import click

from sparkpack.formats.errors import cli_entry

# module -> attribute holding the click command. Imported lazily so `repack --help` stays fast
# and a command's heavy imports (torch, datasets) load only when it runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("sparkpack.repack.inspect_cmd", "inspect_cmd"),
    "synth": ("sparkpack.repack.synth_cmd", "synth_cmd"),
    "demo": ("sparkpack.repack.demo_cmd", "demo_cmd"),
    "convert-hf": ("sparkpack.repack.convert_hf_cmd", "convert_hf_cmd"),
    "split": ("sparkpack.repack.split_cmd", "split_cmd"),
    "join": ("sparkpack.repack.join_cmd", "join_cmd"),
    "verify": ("sparkpack.repack.verify_cmd", "verify_cmd"),
    "calibrate": ("sparkpack.repack.calibrate_cmd", "calibrate_cmd"),
    "report": ("sparkpack.repack.report_cmd", "report_cmd"),
    "export": ("sparkpack.repack.export_cmd", "export_cmd"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def resolve_command(self, ctx: click.Context, args: list[str]):  # type: ignore[override]
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in COMMANDS:
            close = difflib.get_close_matches(name, COMMANDS, n=1)
            ctx.fail(f"no such command '{name}'" + (f"; did you mean '{close[0]}'?" if close else ""))
        return super().resolve_command(ctx, args)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sparkpack")
def cli() -> None:
    """Repack MoE GGUF models so their experts stream from host RAM to a small GPU.

    \b
    Typical flow:
      repack calibrate model.gguf --corpus logs/   # learn which experts your traffic uses
      repack split model.gguf --vram 14GiB         # GGUF -> model.sparkpack
      spark-run model.sparkpack                    # chat / serve
    """


def main() -> None:
    cli_entry(cli, "repack")


if __name__ == "__main__":
    main()
