"""Where the tests find their data: the repository's sample corpora, the shared real corpora
beside the checkout, and llama.cpp's source package (real chat templates, vocabularies, model
definitions) that the README's test command downloads."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_CORPORA = REPO / ".." / "shared" / "corpora"
CLAUDE = REPO / "corpora" / "claude_code"
CODEX = REPO / "corpora" / "codex"

SDIST_HINT = ("llama.cpp's real chat templates not found: the README's test command downloads llama-cpp-python "
              "0.3.36's source package into .cache/ (pip download --no-deps --no-binary :all: -d .cache "
              "llama-cpp-python==0.3.36); or set SPARKPACK_LLAMA_CPP_SDIST to it or to its unpacked folder")


def sdist_candidates() -> list[Path]:
    """llama-cpp-python source packages (or an unpacked one) to read llama.cpp's files from."""
    found = [Path(os.environ["SPARKPACK_LLAMA_CPP_SDIST"])] if os.environ.get("SPARKPACK_LLAMA_CPP_SDIST") else []
    found += sorted((REPO / ".cache").glob("llama_cpp_python-*.tar.gz"))  # README's test command
    cache = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip")
    if cache.is_dir():
        found += sorted(cache.rglob("llama_cpp_python-*.tar.gz"))
    return found


def llama_cpp_model_file(name: str) -> bytes | None:
    """llama.cpp's ``models/NAME`` (its vocabulary-only GGUFs and their tokenizer test vectors)
    from the first source package that has it; None where none does."""
    import tarfile

    for source in sdist_candidates():
        if source.is_dir():
            found = next(source.rglob(f"models/{name}"), None)
            if found is not None:
                return found.read_bytes()
        elif source.is_file():
            with tarfile.open(source) as tar:
                member = next((m for m in tar if m.name.endswith(f"/models/{name}")), None)
                if member is not None:
                    return tar.extractfile(member).read()
    return None
