"""The install puts one name on the path, ``sparkpack``, and the package list covers every folder."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_package_list_covers_every_package_folder():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = cfg["package-dir"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in mapped.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed, f"pyproject's packages differ from the folders: missing {found - listed}, extra {listed - found}"
    assert all(n.startswith("sparkpack.") for n in listed)


def test_generic_top_level_names_are_not_importable(tmp_path):
    """``formats``, ``runtime``... must not shadow or be shadowed by other packages of those names."""
    code = ("import importlib.util, sys; "
            "print([n for n in ('formats', 'calibrate', 'repack', 'runtime') if importlib.util.find_spec(n)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path).stdout.strip()
    assert out == "[]"
    code = "import sparkpack.runtime.cli, sparkpack.repack.cli, sparkpack.formats.gguf_file; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path).stdout.strip() == "ok"
