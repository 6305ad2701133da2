"""Seeded hostile inputs and the oracle that judges what the commands do with them.

Six kinds of case, each derived from ``random.Random(f"{seed}:{index}")`` so any case can be
replayed alone: ``gguf`` (a synthetic model's header with bytes, counts, types or metadata values
changed), ``manifest`` (a pack's manifest edited field by field, re-sealed or not, or its text
damaged), ``shard`` (pack bytes flipped, zeroed, truncated, swapped or re-compressed), ``profile``
(a placement profile edited), ``corpus`` (traffic records of every format with wrong types,
huge or deep values, lone surrogates, junk) and ``overlap`` (one tensor's offset moved onto
another's range, in a GGUF or a pack's header copy or manifest: issue 43). Each case runs the
real commands in this process (``repack inspect/split/join/verify/calibrate``, ``spark-run``)
and the oracle says:

* ``refused``: exit code != 0 with exactly one line on stderr (a traceback escaping is
  ``traceback``; more lines is ``noisy``);
* ``ok``: success whose output round-trips: a pack split from a hostile GGUF joins back to it
  byte for byte; a pack that verifies joins to the source GGUF byte for byte and spark-run
  gives the clean pack's exact logits; a pack join accepts rebuilds the source exactly; a
  profile split accepts gives a pack that verifies;
* ``accepted``: success with a wrong output: a corruption accepted (by verify, join or spark-run);
  for ``overlap``, which is never sound, any command that reads the moved map and succeeds.

Hangs, memory blow-ups and crashes are judged by the process running the cases
(``tests/fuzz_runner.py``), which bounds each case's time and memory.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import struct
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
KINDS = ("gguf", "manifest", "shard", "profile", "corpus", "overlap")
IDS = "1,7,300,42"
INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 63, 64, 4095, 4096, 2**16, 16_000_000, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                    2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**1100, -2**63]


@dataclass
class Result:
    kind: str
    outcome: str  # ok | refused | noisy | traceback | accepted
    detail: str = ""


class Bench:
    """The clean inputs every case starts from, built once per process under ``root``."""

    def __init__(self, root: Path):
        from sparkpack.formats.archs import model_spec
        from sparkpack.formats.gguf_file import GGUFModel
        from sparkpack.formats.profile import Profile, model_identity
        from sparkpack.repack.synth import write_synthetic

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.models = {}
        for arch, quant in (("qwen3moe", "Q4_K_M"), ("qwen35moe", "Q8_0")):
            path = root / f"{arch}.gguf"
            if not path.exists():
                write_synthetic(path, arch, "tiny", quant, seed=1, skew=0.0)
            self.models[arch] = path
        self.packs: dict[str, tuple[Path, Path]] = {}  # name -> (pack, its source GGUF)
        for arch, src in self.models.items():
            for variant, extra in (("plain", []), ("zstd", ["--compress"])):
                pack = root / f"{arch}-{variant}.sparkpack"
                if not pack.exists():
                    code, err = cli("repack", "split", src, "-o", pack, "--hot-fraction", "0.5", *extra)
                    assert code == 0, err
                self.packs[f"{arch}-{variant}"] = (pack, src)
            v1 = root / f"{arch}-v1.sparkpack"
            if not v1.exists():
                from tests.pack_edit import to_version_1

                shutil.copytree(root / f"{arch}-plain.sparkpack", v1)
                to_version_1(v1)
            self.packs[f"{arch}-v1"] = (v1, src)
        self.logits = {}
        for name, (pack, _) in self.packs.items():
            out = root / f"{name}.npy"
            if not out.exists():
                code, err = cli("spark-run", pack, "--device", "cpu", "--prompt-ids", IDS, "--logits-out", out)
                assert code == 0, err
            self.logits[name] = np.load(out)
        self.profile = root / "qwen3moe.profile.json"
        with GGUFModel(self.models["qwen3moe"]) as m:
            spec = model_spec(m)
            prof = Profile.new(model_identity(m), spec)
        rng = np.random.default_rng(0)
        prof.add(prompt=rng.integers(0, 50, (spec.n_layer, spec.n_expert)), prompt_tokens=100,
                 generated=rng.integers(0, 50, (spec.n_layer, spec.n_expert)), generated_tokens=80)
        prof.save(self.profile)
        self.corpus_seeds = _corpus_seeds()
        self._renderer = None

    def renderer(self):
        """The chat renderer of the qwen3moe model (template and tokenizer), as calibrate builds it."""
        if self._renderer is None:
            from sparkpack.calibrate.render import ChatRenderer
            from sparkpack.formats.gguf_file import GGUFModel
            from sparkpack.runtime.chat_template import ChatTemplate
            from sparkpack.runtime.tokenizer import GGUFTokenizer

            g = GGUFModel(self.models["qwen3moe"])
            tok = GGUFTokenizer.from_metadata(g)
            self._renderer = ChatRenderer(tok, ChatTemplate.from_tokenizer(g.get("tokenizer.chat_template"), tok).render)
        return self._renderer


# --- running commands in-process --------------------------------------------------------------

class Escaped(Exception):
    """An exception escaped a command's entry point (a traceback the user would see)."""


def cli(prog: str, *args: object) -> tuple[int, str]:
    """``repack``/``spark-run`` ARGS through their real entry points: (exit code, stderr)."""
    if prog == "repack":
        from sparkpack.repack.cli import main
    else:
        from sparkpack.runtime.cli import main
    err = io.StringIO()
    argv = sys.argv
    sys.argv = [prog, *map(str, args)]
    code = 0
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except MemoryError:
        raise
    except BaseException as e:  # noqa: BLE001 - the point is to see it
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        raise Escaped(f"{prog} {' '.join(map(str, args[:1]))}: {type(e).__name__} at {where}: {str(e)[:120]}") from e
    finally:
        sys.argv = argv
    return code, err.getvalue()


def judge_refusal(code: int, err: str, prog: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(f"{prog}: error:")]
    if "Traceback" in err:
        return "traceback"
    return "refused" if len(errors) == 1 and errors[0] == lines[-1] else "noisy"


# --- random values ----------------------------------------------------------------------------

def random_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.2:
        return rng.choice(INTERESTING_INTS)
    if r < 0.3:
        return rng.choice([0.0, -0.0, 1e308, -1.5, 1e-300, 3.14])
    if r < 0.4:
        return rng.choice([True, False, None])
    if r < 0.55:
        return rng.choice(["", "x", "hot.bin", "../../etc/passwd", "\ud800", "sha256:" + "0" * 64, "zstd", "a" * 300,
                           "xxh3_128:" + "f" * 32, "NaN", "1e999", "\x00"])
    if r < 0.65 and depth < 3:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.75 and depth < 3:
        return {rng.choice(["a", "offset", "nbytes", "shard"]): random_json(rng, depth + 1) for _ in range(2)}
    if r < 0.8:
        return deep(rng.choice([20, 70, 400]))  # deeper ones are written as text (json.dumps recurses)
    return rng.randint(-10, 10**6)


def deep(n: int) -> Any:
    v: Any = []
    for _ in range(n):
        v = [v]
    return v


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) inside a JSON value, lists sampled so huge ones stay cheap."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, prefix + (k,))
    elif isinstance(value, list):
        idx = range(len(value)) if len(value) <= 8 else sorted({0, 1, len(value) - 1, len(value) // 2})
        for i in idx:
            out += paths(value[i], prefix + (i,))
    return out


def edit_at(doc: Any, path: tuple, rng: random.Random) -> str:
    """Change the value at ``path``: a nearby number, another type, removal, duplication."""
    if not path:
        return "root untouched"
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    r = rng.random()
    if isinstance(old, bool) or not isinstance(old, int) or r < 0.3:
        new = random_json(rng)
    else:
        new = old + rng.choice([-4096, -64, -32, -1, 1, 32, 64, 4096, old, -old, 2**63])
    if r > 0.9 and isinstance(parent, dict):
        del parent[key]
        return f"deleted {'.'.join(map(str, path))}"
    if r > 0.85 and isinstance(parent, list):
        parent.insert(key, old) if rng.random() < 0.5 else parent.pop(key)
        return f"list at {'.'.join(map(str, path[:-1]))} resized"
    parent[key] = new
    return f"{'.'.join(map(str, path))} = {str(new)[:40]}"


def flip_bytes(path: Path, rng: random.Random, lo: int = 0, hi: int | None = None, n: int | None = None) -> str:
    data = bytearray(path.read_bytes())
    if not data:
        return "empty"
    hi = len(data) if hi is None else min(hi, len(data))
    where = []
    for _ in range(n or rng.choice([1, 1, 1, 2, 4, 16])):
        i = rng.randrange(lo, max(lo + 1, hi))
        data[i] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
        where.append(i)
    path.write_bytes(bytes(data))
    return f"flipped bytes at {where[:4]}"


# --- the cases --------------------------------------------------------------------------------

def run_case(bench: Bench, seed: int, index: int, scratch: Path) -> Result:
    rng = random.Random(f"{seed}:{index}")
    kind = KINDS[index % len(KINDS)] if rng.random() < 0.9 else rng.choice(KINDS)
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    fn: Callable[[Bench, random.Random, Path], Result] = CASES[kind]
    try:
        return fn(bench, rng, scratch)
    except Escaped as e:
        return Result(kind, "traceback", str(e))
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - outside a command: the case itself or a library call it makes
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        return Result(kind, "traceback", f"{type(e).__name__} at {where}: {str(e)[:150]}")


def gguf_case(bench: Bench, rng: random.Random, d: Path) -> Result:
    from sparkpack.formats.gguf_header import scan_header
    from tests.gguf_edit import DROP, rewrite

    src = bench.models[rng.choice(list(bench.models))]
    path = d / "m.gguf"
    data = src.read_bytes()
    index = scan_header(data, src)
    r = rng.random()
    if r < 0.3:  # metadata value of another type or value
        key = rng.choice([k for k in index.fields if rng.random() < 0.7 or "." in k])
        import gguf

        T = gguf.GGUFValueType
        value = rng.choice([("x", T.STRING), (rng.choice(INTERESTING_INTS[:20]) % 2**32, T.UINT32),
                            (float("nan"), T.FLOAT32), (float("inf"), T.FLOAT64), (True, T.BOOL), DROP,
                            ([1, 2, 3], T.ARRAY, T.INT32), (["a", "b"], T.ARRAY, T.STRING), (-5, T.INT32),
                            (rng.choice(INTERESTING_INTS[:20]) % 2**63, T.UINT64)])
        rewrite(src, path, {key: value})
        what = f"{key} := {str(value)[:40]}"
    elif r < 0.65:  # a count, length, type or dimension in the header overwritten
        positions = [8, 16] + [pos - 12 for _, pos in index.fields.values()] + [pos for _, pos in index.fields.values()]
        positions += [pos + 4 for vt, pos in index.fields.values() if vt == 9]
        pos = rng.choice(positions)
        width = rng.choice([4, 8])
        value = rng.choice(INTERESTING_INTS) % 2**(8 * width)
        buf = bytearray(data)
        struct.pack_into("<Q" if width == 8 else "<I", buf, min(pos, len(buf) - width), value)
        path.write_bytes(bytes(buf))
        what = f"u{8 * width} at {pos} = {value}"
    elif r < 0.9:
        path.write_bytes(data)
        what = flip_bytes(path, rng, 0, index.data_offset)
    else:
        cut = rng.randrange(0, len(data))
        path.write_bytes(data[:cut])
        what = f"truncated at {cut}"
    code, err = cli("repack", "inspect", path)
    if code != 0:
        return Result("gguf", judge_refusal(code, err, "repack"), what)
    if rng.random() < 0.5:  # what split accepts must join back to the same bytes
        pack = d / "m.sparkpack"
        code, err = cli("repack", "split", path, "-o", pack, "--hot-fraction", "0.3")
        if code != 0:
            return Result("gguf", judge_refusal(code, err, "repack"), what + " (split)")
        code, err = cli("repack", "join", pack, "-o", d / "back.gguf")
        if code != 0 or (d / "back.gguf").read_bytes() != path.read_bytes():
            return Result("gguf", "accepted", what + f": split then join did not round-trip ({err.strip()[:100]})")
    else:
        code, err = cli("spark-run", path, "--device", "cpu", "--prompt-ids", IDS, "--logits-out", d / "x.npy")
        if code != 0:
            return Result("gguf", judge_refusal(code, err, "spark-run"), what + " (spark-run)")
    return Result("gguf", "ok", what)


def _pack_copy(bench: Bench, rng: random.Random, d: Path) -> tuple[str, Path, Path]:
    name = rng.choice(sorted(bench.packs))
    pack, src = bench.packs[name]
    dst = d / "p.sparkpack"
    shutil.copytree(pack, dst)
    return name, dst, src


def _judge_pack(bench: Bench, rng: random.Random, d: Path, kind: str, name: str, pack: Path, src: Path, what: str,
                forged: bool) -> Result:
    """verify, join, spark-run on a damaged pack. ``forged``: the manifest was re-sealed after an
    edit of its metadata, which spark-run takes as written (verify and join must still refuse)."""
    v_code, v_err = cli("repack", "verify", pack)
    out = d / "back.gguf"
    j_code, j_err = cli("repack", "join", pack, "-o", out)
    if j_code == 0 and out.read_bytes() != src.read_bytes():
        return Result(kind, "accepted", f"{what}: join wrote a different file")
    if j_code != 0 and (out.exists() or list(d.glob(".back.gguf*"))):
        return Result(kind, "accepted", f"{what}: join failed but left a file behind")
    if v_code == 0 and j_code != 0:
        return Result(kind, "accepted", f"{what}: verify passed, join refused ({j_err.strip()[:100]})")
    run_args = ["--hot-fraction", "0.5"] if rng.random() < 0.5 else []
    s_code, s_err = cli("spark-run", pack, "--device", "cpu", "--prompt-ids", IDS, "--logits-out", d / "x.npy",
                        *run_args)
    if s_code == 0 and not np.array_equal(np.load(d / "x.npy"), bench.logits[name]) and not forged:
        return Result(kind, "accepted", f"{what}: spark-run computed different logits")
    if v_code == 0 and s_code != 0:
        return Result(kind, "accepted", f"{what}: verify passed, spark-run refused ({s_err.strip()[:100]})")
    for code, err, prog in ((v_code, v_err, "repack"), (j_code, j_err, "repack"), (s_code, s_err, "spark-run")):
        if code != 0 and judge_refusal(code, err, prog) != "refused":
            return Result(kind, judge_refusal(code, err, prog), f"{what}: {err.strip()[-200:]}")
    return Result(kind, "ok" if v_code == 0 else "refused", what)


def manifest_case(bench: Bench, rng: random.Random, d: Path) -> Result:
    from tests.pack_edit import read_manifest, write_manifest

    name, pack, src = _pack_copy(bench, rng, d)
    raw = json.loads((pack / "manifest.json").read_text())
    old = raw.get("manifest_checksum")
    if rng.random() < 0.2:
        what = "manifest text " + flip_bytes(pack / "manifest.json", rng)
        forged = False
    else:
        m = read_manifest(pack)
        structural = [p for p in paths(m) if p and p[0] in ("tensors", "experts", "source", "shards", "spec", "version",
                                                            "checksum", "compression", "alignment", "arch")]
        path = rng.choice(structural if rng.random() < 0.8 else paths(m))
        what = "manifest " + edit_at(m, path, rng)
        reseal = rng.random() < 0.5
        write_manifest(pack, m, reseal, old)
        forged = reseal and bool(path) and path[0] in ("metadata", "spec")
    return _judge_pack(bench, rng, d, "manifest", name, pack, src, what, forged)


def shard_case(bench: Bench, rng: random.Random, d: Path) -> Result:
    import zstandard

    from sparkpack.formats.sparkpack import Pack

    name, pack, src = _pack_copy(bench, rng, d)
    p = Pack.open(pack)
    cold = [r for r in p.records.values() if not r.hot]
    shards = ["hot.bin", "header.bin"] + [r.shard for r in cold]
    r = rng.random()
    target = pack / rng.choice(shards)
    if r < 0.5:
        what = f"{target.name} " + flip_bytes(target, rng)
    elif r < 0.6:
        size = target.stat().st_size
        cut = rng.randrange(0, max(1, size))
        with open(target, "r+b") as f:
            f.truncate(cut if rng.random() < 0.7 else size + rng.randint(1, 5000))
        what = f"{target.name} resized from {size}"
    elif r < 0.7:
        target.write_bytes(bytes(target.stat().st_size))
        what = f"{target.name} zero-filled"
    elif r < 0.8 and len(cold) > 1:
        a, b = rng.sample(cold, 2)
        tmp = pack / "swap"
        os.rename(pack / a.shard, tmp)
        os.rename(pack / b.shard, pack / a.shard)
        os.rename(tmp, pack / b.shard)
        what = f"swapped {a.shard} and {b.shard}"
    elif r < 0.9 and p.compression:
        rec = rng.choice(cold)
        data = bytearray(zstandard.ZstdDecompressor().decompress((pack / rec.shard).read_bytes()))
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (pack / rec.shard).write_bytes(zstandard.ZstdCompressor(level=3).compress(bytes(data)))
        what = f"{rec.shard} re-compressed with a byte changed"
    elif r < 0.93 and p.compression:
        what = _claim_content_size(pack, rng.choice(cold), rng)
    elif r < 0.97 and cold:
        rec = rng.choice(cold)
        (pack / rec.shard).unlink()
        if rng.random() < 0.5:
            os.mkfifo(pack / rec.shard)
            what = f"{rec.shard} replaced by a FIFO"
        else:
            os.symlink("/dev/zero", pack / rec.shard)
            what = f"{rec.shard} replaced by a link to /dev/zero"
    else:
        what = f"{target.name} " + flip_bytes(target, rng, n=64)
    return _judge_pack(bench, rng, d, "shard", name, pack, src, what, False)


def _claim_content_size(pack: Path, rec, rng: random.Random) -> str:
    """A zstd frame whose header claims another content size (1 TiB, say), its shard checksum
    and the manifest re-sealed around it: only the decompression bound can catch it."""
    from sparkpack.formats.checksums import checksum
    from tests.pack_edit import edit_manifest

    raw = (pack / rec.shard).read_bytes()
    fhd = raw[4]
    single = (fhd >> 5) & 1
    old_header = 5 + (0 if single else 1) + (fhd & 3 and [0, 1, 2, 4][fhd & 3]) + {0: single, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    claim = rng.choice([1 << 40, 2**64 - 2, rec.nbytes + 1, rec.nbytes - 1, 0])
    new = raw[:4] + bytes([0xE0 | (fhd & 4)]) + claim.to_bytes(8, "little") + raw[old_header:]
    (pack / rec.shard).write_bytes(new)

    def fix(m):
        lay = next(lay for lay in m["experts"] if lay["layer"] == rec.layer)
        lay["experts"][rec.expert].update(stored_nbytes=len(new), shard_checksum=checksum(m["checksum"], new))
    edit_manifest(pack, fix)
    return f"{rec.shard} frame claims {claim} bytes (checksums re-sealed)"


def profile_case(bench: Bench, rng: random.Random, d: Path) -> Result:
    prof = d / "p.json"
    doc = json.loads(bench.profile.read_text())
    r = rng.random()
    if r < 0.15:
        prof.write_bytes(bench.profile.read_bytes())
        what = flip_bytes(prof, rng)
    elif r < 0.25:
        text = rng.choice(["[" * 100000, "{}" * 5, json.dumps(doc).replace("0,", "NaN,", 1),
                           json.dumps(doc).replace("0,", "1" * 5000 + ",", 1), "\x00\xff", ""])
        prof.write_text(text, errors="surrogateescape")
        what = f"profile text {text[:20]!r}"
    else:
        path = rng.choice(paths(doc))
        what = edit_at(doc, path, rng)
        prof.write_text(json.dumps(doc))
    code, err = cli("repack", "split", bench.models["qwen3moe"], "--profile", prof, "-o", d / "m.sparkpack",
                    "--hot-fraction", "0.2")
    if code != 0:
        return Result("profile", judge_refusal(code, err, "repack"), what)
    from sparkpack.repack.verify_cmd import verify_pack

    verify_pack(d / "m.sparkpack")  # raises (an escape) if split wrote a pack that does not verify
    return Result("profile", "ok", what)


# --- corpus ---------------------------------------------------------------------------------------

def _corpus_seeds() -> dict[str, list[str]]:
    """name -> lines of every sample format we ship (corpora/), the file's suffix in the name."""
    base = REPO / "corpora"
    out = {}
    for p in [base / "openai_chat.jsonl", base / "anthropic_messages.jsonl", base / "prompts.jsonl",
              *sorted((base / "claude_code").glob("*.jsonl")), *sorted((base / "codex").glob("*.jsonl"))]:
        out[f"{p.parent.name}-{p.name}"] = p.read_text().splitlines()
    out["sharegpt.json"] = [(base / "sharegpt.json").read_text()]
    out["notes.md"] = [(base / "notes.md").read_text()]
    return out


def _mutate_record(line: str, rng: random.Random) -> tuple[str, str]:
    r = rng.random()
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        value = None
    if value is not None and r < 0.55:
        path = rng.choice(paths(value))
        what = edit_at(value, path, rng) if path else "root"
        if rng.random() < 0.15:  # a huge string somewhere: near and over the record cap
            parent = value
            with contextlib.suppress(IndexError, KeyError, TypeError):
                for k in path[:-1]:
                    parent = parent[k]
            n = rng.choice([100_000, (2 << 20) + 10, (9 << 20)])
            with contextlib.suppress(IndexError, KeyError, TypeError):  # (the edit may have removed it)
                parent[path[-1]] = rng.choice("a1 \n") * n
                what = f"{'.'.join(map(str, path))} = {n} chars"
        return json.dumps(value, ensure_ascii=rng.random() < 0.5), what
    if r < 0.65:
        return "[" * rng.choice([70, 3000, 200000]) + "]" * rng.choice([0, 70]), "deep nesting"
    if r < 0.72:
        return line.replace('"', '"\\ud800', 1) if '"' in line else line, "lone surrogate"
    if r < 0.78:
        return line.replace(":", ": 1" + "0" * rng.choice([20, 400, 5000]) + ",", 1), "huge number"
    if r < 0.85:
        return line[: rng.randrange(len(line) + 1)], "truncated line"
    if r < 0.9:
        return "\x00" * rng.randint(1, 100) + line, "NUL bytes"
    if r < 0.95:
        return json.dumps(random_json(rng)), "random JSON"
    return bytes(rng.randrange(256) for _ in range(200)).decode("latin-1"), "binary junk"


def corpus_case(bench: Bench, rng: random.Random, d: Path) -> Result:
    name = rng.choice(sorted(bench.corpus_seeds))
    lines = list(bench.corpus_seeds[name])
    what = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        i = rng.randrange(len(lines))
        lines[i], w = _mutate_record(lines[i], rng)
        what.append(f"line {i + 1}: {w}")
    folder = d / "corpus" / name.split("-")[0]
    folder.mkdir(parents=True)
    path = folder / name.split("-", 1)[-1]
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write("\n".join(lines) + "\n")
    desc = f"{name}: " + "; ".join(what)
    if rng.random() < 0.03:  # the whole command, model included
        code, err = cli("repack", "calibrate", bench.models["qwen3moe"], "--corpus", d / "corpus", "-o", d / "p.json",
                        "--device", "cpu", "--quiet", "--max-tokens", "200")
        if code != 0:
            return Result("corpus", judge_refusal(code, err, "repack"), desc + " (calibrate)")
        from sparkpack.formats.profile import Profile

        Profile.load(d / "p.json")
        return Result("corpus", "ok", desc + " (calibrate)")
    from sparkpack.calibrate.readers import read_corpus
    from sparkpack.calibrate.render import RenderError

    try:
        convs, stats = read_corpus(d / "corpus")
        for conv in convs:
            try:
                bench.renderer().render(conv)
            except RenderError:
                pass  # the template refused it: replay counts it as skipped
        stats.summary()
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)
        return Result("corpus", "traceback", f"{desc}: {type(e).__name__} at {Path(tb[-1].filename).name}:"
                                             f"{tb[-1].lineno}: {str(e)[:100]}")
    return Result("corpus", "ok", desc)


# --- tensors moved onto each other ---------------------------------------------------------------

def _overlap_pair(src: Path, how: str, rng: random.Random) -> tuple[str, str]:
    """A tensor to move and one to land on (big enough to start inside, for "partial")."""
    from sparkpack.formats.gguf_file import GGUFModel

    with GGUFModel(src) as m:
        tensors, align = list(m.tensors.values()), m.alignment
    target = rng.choice([t for t in tensors if how != "partial" or t.nbytes >= 2 * align])
    return rng.choice([t.name for t in tensors if t.name != target.name]), target.name


def _must_refuse(runs: list[tuple[str, int, str]], mover: str, what: str) -> Result:
    """Every command refused, in one line naming the moved tensor; a success is a silent
    acceptance of a file ggml refuses."""
    for prog, code, err in runs:
        if code == 0:
            return Result("overlap", "accepted", f"{what}: {prog} accepted it")
        judged = judge_refusal(code, err, prog.split()[0])
        if judged != "refused":
            return Result("overlap", judged, f"{what}: {err.strip()[-200:]}")
        if mover not in err:
            return Result("overlap", "accepted", f"{what}: {prog} refused it for another reason: {err.strip()[:150]}")
    return Result("overlap", "refused", what)


def overlap_case(bench: Bench, rng: random.Random, d: Path) -> Result:
    """Issue 43's family: one tensor's offset moved onto another's range (``gguf_edit.OVERLAPS``:
    onto, same offset, partial, wrapped into the header) in a GGUF, in a pack's header copy
    (identity and checksums re-computed) or in a pack's manifest (re-sealed). Such a file is
    never sound: every command that reads the moved map must refuse it."""
    from tests.gguf_edit import OVERLAPS, move_tensor
    from tests.pack_edit import overlap_in_header, overlap_in_manifest

    how = rng.choice(OVERLAPS)
    where = rng.choice(["gguf", "gguf", "header copy", "manifest"])
    if where == "gguf":
        src = bench.models[rng.choice(sorted(bench.models))]
        mover, target = _overlap_pair(src, how, rng)
        path = d / "m.gguf"
        shutil.copy(src, path)
        move_tensor(path, mover, target, how)
        what = f"gguf {mover} moved {how} {target}"
        corpus = d / "c.jsonl"
        corpus.write_text(json.dumps({"prompt": "hello"}) + "\n")
        runs = [(" ".join(map(str, [prog, *args[:1]])), *cli(prog, *args)) for prog, args in (
            ("repack", ["inspect", path]), ("repack", ["split", path, "-o", d / "m.sparkpack"]),
            ("spark-run", [path, "--device", "cpu", "--prompt-ids", IDS, "--logits-out", d / "x.npy"]),
            ("repack", ["calibrate", path, "--corpus", corpus, "-o", d / "p.json", "--device", "cpu", "--quiet"]))]
        return _must_refuse(runs, mover, what)
    name, pack, src = _pack_copy(bench, rng, d)
    mover, target = _overlap_pair(src, how, rng)
    what = f"{name} {where}: {mover} moved {how} {target}"
    (overlap_in_header if where == "header copy" else overlap_in_manifest)(pack, mover, target, how)
    runs = [("repack verify", *cli("repack", "verify", pack)),
            ("repack join", *cli("repack", "join", pack, "-o", d / "back.gguf"))]
    s_code, s_err = cli("spark-run", pack, "--device", "cpu", "--prompt-ids", IDS, "--logits-out", d / "x.npy")
    reads_header = where == "manifest" or name.endswith("-v1")  # a v2 pack's header copy is read by verify, join
    if reads_header or s_code != 0:
        runs.append(("spark-run", s_code, s_err))
    elif not np.array_equal(np.load(d / "x.npy"), bench.logits[name]):
        return Result("overlap", "accepted", f"{what}: spark-run computed different logits")
    return _must_refuse(runs, mover, what)


CASES: dict[str, Callable[[Bench, random.Random, Path], Result]] = {
    "gguf": gguf_case, "manifest": manifest_case, "shard": shard_case, "profile": profile_case, "corpus": corpus_case,
    "overlap": overlap_case}
