"""The install puts one name on the path, ``sparkpack``, and the package list covers every folder."""
from __future__ import annotations

import re
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


# Which of our packages each may import: data flows formats -> calibrate -> repack and formats ->
# runtime; runtime may read calibrate's logs (bootstrap); the repack CLI composes the runtime to
# replay a corpus. Nothing imports against this (runtime never imports repack).
ALLOWED = {
    "formats": set(),
    "calibrate": {"formats"},
    "runtime": {"formats", "calibrate"},
    "repack": {"formats", "calibrate", "runtime"},
}
# formats is read by every stage, on machines without a GPU stack: no torch, no Triton
TORCH_FREE = {"formats"}


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports (at any depth, lazy imports too), relative ones resolved."""
    import ast

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from sparkpack import runtime` names the subpackage
            out += [(node.lineno, f"{base}.{a.name}" if base == "sparkpack" else base) for a in node.names]
    return out


def test_imports_follow_the_data_flow():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    wrong = []
    for name, folder in cfg.items():
        stage = name.removeprefix("sparkpack.")
        if stage not in ALLOWED:
            continue
        for path in sorted((REPO / folder).rglob("*.py")):
            module = ".".join([name, *path.relative_to(REPO / folder).with_suffix("").parts]).removesuffix(".__init__")
            for line, target in _imports(path, module):
                top = target.split(".")
                if top[0] == "sparkpack" and len(top) > 1 and top[1] != stage and top[1] not in ALLOWED[stage]:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {target}")
                if top[0] in ("tests", "bench"):  # test hooks are injected by tests, never imported
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {target} (test and bench code)")
                if stage in TORCH_FREE and top[0] in ("torch", "triton"):
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {target} ({stage} is torch-free)")
    assert not wrong, "imports against the data flow:\n" + "\n".join(wrong)
    assert set(ALLOWED) == {n.removeprefix("sparkpack.") for n in cfg if n.count(".") == 1}, "a new stage needs its row"


def test_the_cache_policy_has_one_home():
    """The expert store and the trace simulator of ``repack calibrate --eval`` run the same policy
    code (``formats.cache_policy``): the store's modules import no policy (nothing) from calibrate,
    and neither side defines policies of its own."""
    runtime, calibrate = REPO / "runtime", REPO / "calibrate"
    store = sorted(runtime.glob("expert_*.py"))
    wrong = [f"{p.relative_to(REPO)}:{line} imports {t}" for p in store
             for line, t in _imports(p, f"sparkpack.runtime.{p.stem}") if t.startswith("sparkpack.calibrate")]
    assert store and not wrong, wrong
    users = {"runtime/expert_slots.py", "runtime/expert_misses.py", "calibrate/cache_policies.py"}
    for rel in users:
        name = "sparkpack." + rel.removesuffix(".py").replace("/", ".")
        assert any(t == "sparkpack.formats.cache_policy" for _, t in _imports(REPO / rel, name)), rel
    import ast

    for path in [*store, *sorted(calibrate.rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                assert "SlotPolicy" not in bases, f"{path.relative_to(REPO)}: policy {node.name} outside formats"
# Boundaries inside a stage: (the files, the package they may import freely, what they may not
# import). The kernels know no server; a tool-call syntax's parser reads the shared streaming
# machinery through ``CallStream`` only; the models and the conversation cache know no server;
# the expert store's modules know no model, server or calibration (its policies are formats');
# the parts a model composes know no arch file; the conversation cache's tiers, files and
# snapshots sit below the cache; the output events are a leaf every dialect reads; reading a
# tool call is text.
ARCH_FILES = tuple(f"sparkpack.runtime.models.{a}" for a in ("laguna", "qwen3moe", "qwen35moe", "qwen35moe_mtp"))
INSIDE = [
    (("runtime/kernels/*.py",), "sparkpack.runtime.kernels", ("sparkpack.runtime.server",)),
    (("runtime/server/tool_parsers/*.py",), "sparkpack.runtime.server.tool_parsers",
     ("sparkpack.runtime.server", "torch", "triton")),
    (("runtime/models/*.py", "runtime/conversation_*.py"), None, ("sparkpack.runtime.server",)),
    (("runtime/expert_*.py",), None, ("sparkpack.runtime.models", "sparkpack.runtime.server", "sparkpack.calibrate")),
    (("runtime/models/attention.py", "runtime/models/projections.py", "runtime/models/moe_block.py",
      "runtime/models/row_steps.py"), None,
     ARCH_FILES),
    (("runtime/conversation_index.py", "runtime/conversation_files.py", "runtime/conversation_host.py",
      "runtime/conversation_folder.py", "runtime/conversation_snapshot.py"), None,
     ("sparkpack.runtime.conversation_cache",)),
    (("runtime/server/output_events.py",), None, ("sparkpack",)),
    (("runtime/server/call_stream.py",), None, ("torch", "triton")),
]


def _module_of(path: Path) -> str:
    return ".".join(["sparkpack", *path.relative_to(REPO).with_suffix("").parts]).removesuffix(".__init__")


def _breaks(path: Path, module: str, own: str | None, forbidden: tuple[str, ...]) -> list[str]:
    """The imports of ``path`` (as ``module``) that name one of ``forbidden`` or a module below
    it, those inside ``own`` aside; type-only imports count too (a type is a dependency)."""
    out = []
    for line, target in _imports(path, module):
        if own is not None and target.startswith(own):
            continue
        if any(target == f or target.startswith(f + ".") for f in forbidden):
            out.append(f"{path.name}:{line} imports {target}")
    return out


def test_boundaries_inside_the_runtime():
    wrong = []
    for patterns, own, forbidden in INSIDE:
        paths = sorted({p for pattern in patterns for p in REPO.glob(pattern)})
        assert paths, patterns  # (a rule over files that moved away checks nothing)
        for path in paths:
            wrong += [f"{path.parent.relative_to(REPO)}/{b}" for b in _breaks(path, _module_of(path), own, forbidden)]
    assert not wrong, "\n".join(wrong)


def test_the_boundary_check_sees_a_break(tmp_path):
    """Each kind of break the rules name is found: a kernel importing the server (relative and
    lazy), the store importing calibrate, a model part importing its arch file (type-only), and
    the events importing anything of ours (``from sparkpack import ...``)."""
    cases = [("from ..server.app import create_app\n", "sparkpack.runtime.kernels.moe", ("sparkpack.runtime.server",)),
             ("def f():\n    from sparkpack.calibrate import replay\n", "sparkpack.runtime.expert_store",
              ("sparkpack.calibrate",)),
             ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .laguna import Laguna\n",
              "sparkpack.runtime.models.attention", ARCH_FILES),
             ("from sparkpack import formats\n", "sparkpack.runtime.server.output_events", ("sparkpack",))]
    for source, module, forbidden in cases:
        f = tmp_path / "m.py"
        f.write_text(source)
        assert _breaks(f, module, None, forbidden), source
    f.write_text("from .tool_parsers.base import State\nimport json\n")
    assert not _breaks(f, "sparkpack.runtime.server.call_stream", None, ("torch", "triton", "sparkpack.calibrate"))


def test_the_import_check_sees_what_it_checks(tmp_path):
    """The walker finds lazy, relative and `from sparkpack import x` imports (or the test above
    could pass by seeing nothing)."""
    f = tmp_path / "m.py"
    f.write_text("import torch\nfrom .. import repack\nfrom ..repack.cli import main\n"
                 "def f():\n    from sparkpack import runtime\n    import sparkpack.repack.outputs\n")
    found = {t for _, t in _imports(f, "sparkpack.formats.m")}
    assert found == {"torch", "sparkpack.repack", "sparkpack.repack.cli", "sparkpack.runtime", "sparkpack.repack.outputs"}


def test_repack_commands_table_loads_each_command():
    """repack's lazily imported commands: each row of the table names a click command of that name."""
    import click

    from sparkpack.repack.cli import COMMANDS, cli

    ctx = click.Context(cli)
    for name in COMMANDS:
        cmd = cli.get_command(ctx, name)
        assert isinstance(cmd, click.Command) and cmd.name == name


# Figures belong in BENCHMARKS.md: product code keeps the reason for a choice, not the machine it
# was timed on or the speed it reached there.
MACHINE_OR_FIGURE = re.compile(r"\b[HA]100\b|\bH200\b|GPU machine|development (?:machine|VM)|[Mm]easured on\b"
                               r"|\d ?(?:tok/s|GB/s|MB/s)\b")


def test_product_code_cites_no_machine_or_measurement():
    hits = []
    for folder in ("formats", "calibrate", "repack", "runtime"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if MACHINE_OR_FIGURE.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_figure_check_sees_figures():
    for line in ("# on the H100 it ran at 40 us", "ran at 12 tok/s", "13 GB/s here", "measured on the GPU machine"):
        assert MACHINE_OR_FIGURE.search(line), line
    assert not MACHINE_OR_FIGURE.search('parts.append(f"decode {n} tok at {rate:.1f} tok/s")')


def _private_reads(source: str, name: str = "<test>") -> list[str]:
    """Where ``source`` (a test file) reaches a private name of another module: an attribute
    ``x._name`` the file does not define itself (its own functions, classes, their ``self._x``,
    its assigned names), ``from m import _name``, or ``"_name"`` handed to getattr/setattr/
    monkeypatch.setattr. Any module's: the walk cannot tell our objects from others', and tests
    of ours read interfaces."""
    import ast

    def private(n: str) -> bool:
        return n.startswith("_") and not (n.startswith("__") and n.endswith("__"))

    tree = ast.parse(source, name)
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        own |= {a.attr for a in ast.walk(cls) if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store)
                and isinstance(a.value, ast.Name) and a.value.id == "self"}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own:
            hits.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            hits += [f"{name}:{node.lineno}: from {node.module} import {a.name}" for a in node.names if private(a.name)]
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and private(node.args[1].value)):
            hits.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return hits


def test_tests_and_benches_read_no_private_names():
    """Tests check interfaces: a private name a test needs becomes public where it lives (a kernel
    a compile test names, a function tests call), or the test checks behaviour instead. The
    benches likewise measure the product through its interfaces, so none of its internals
    stays public, or exists, for a bench alone."""
    hits = [h for folder in ("tests", "bench") for path in sorted((REPO / folder).glob("*.py"))
            for h in _private_reads(path.read_text(), f"{folder}/{path.name}")]
    assert not hits, "\n".join(hits)


def test_the_private_name_check_sees_private_names():
    source = ("from sparkpack.runtime.layers import _attend\n"
              "def test(monkeypatch, engine):\n"
              "    engine._running, graphs = None, object()\n"
              "    monkeypatch.setattr(graphs, '_call', len)\n"
              "    getattr(engine, '_lock')\n"
              "class Own:\n"
              "    def __init__(self):\n"
              "        self._mine = 1\n"
              "    def read(self):\n"
              "        return self._mine, self.__class__, _helper()\n"
              "def _helper():\n"
              "    return Own()._mine\n")
    assert {h.split(": ", 1)[1] for h in _private_reads(source)} == {
        "from sparkpack.runtime.layers import _attend", "engine._running", "monkeypatch.setattr(graphs, '_call', len)",
        "getattr(engine, '_lock')"}


def test_no_test_file_imports_another():
    """Shared helpers live in helper modules (tests/commands.py, kernel_refs.py, ...): importing a
    test file would collect its tests twice and tie the files' fixtures together."""
    import ast

    hits = []
    for path in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), path.name)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            hits += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.startswith(("tests.test_", "test_"))]
    assert not hits, "\n".join(hits)
