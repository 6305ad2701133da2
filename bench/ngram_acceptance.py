"""How much of a real agent continuation ``--draft ngram`` guesses, and what that would make of
decode speed given measured step costs.

    python bench/ngram_acceptance.py TOKENIZER.gguf --lucebox ../shared/corpora/lucebox-hub \
        [--corpus corpora/] [--draft-tokens 2 4] [--ngram 1:3 2:4] \
        [--step-ms all-GPU=2.94,5.50,7.34,9.11,11.07 ...] [--json]

TOKENIZER.gguf: any GGUF with a tokenizer and chat template, weights or not. The real Qwen
tokenizers are in llama.cpp's source, which the test command downloads
(``vendor/llama.cpp/models/ggml-vocab-qwen2.gguf`` in the llama-cpp-python sdist: Qwen2's BPE,
which Qwen3-30B-A3B uses); a ``repack synth`` file's small BPE splits text into more, shorter
tokens than Qwen's, so matches run longer in tokens (the script says so).

Teacher-forced: the continuation is fixed text standing for the main model's greedy output, and
the runtime's drafting loop (``runtime.speculative.speculative_tokens``, with its ``NgramDrafter``
and draft-length rule from ``--draft-tokens``) runs on a session whose model writes that text: the
first token comes from the prompt's logits; then each step either has no draft (a plain decode
step, one token) or verifies its drafts (the longest prefix equal to the text is kept, plus the
verify's own token). Counted: plain steps, verify steps by their number of drafts, drafted and
accepted tokens. Reported: acceptance (accepted / drafted), tokens per step, the share of steps
that drafted and the verify cost (in plain steps) under which drafting pays; with ``--step-ms
LABEL=PLAIN,V1,V2,...`` (a plain step's and a verify of 1, 2, ... drafts' milliseconds, as
``bench/draft_bench.py`` measures them on the GPU) the speed the replay would decode at, as a
multiple of plain decode. Drafts longer than the costs given are refused: a verify's cost is
measured, never extrapolated.

Targets:

* ``--lucebox DIR``: lucebox-hub's agent prompts (``bench_agent.jsonl``: a coding agent's system
  prompt and a user turn holding a real SWE-bench Verified issue and excerpts of the files read),
  rendered with the chat template, and as the continuation the human-written fix of that issue
  (the gold ``patch`` of the same instance in ``swe_bench_verified.parquet``) in two forms: the
  unified diff as written, and the same fix as an agent writes it, one edit tool call a hunk
  (Claude Code's ``Edit``: ``file_path``, ``old_string``, ``new_string``, in Qwen's
  ``<tool_call>`` JSON), which quotes the code it replaces rather than prefixing each line.
* ``--corpus PATH`` (any corpus ``repack calibrate`` reads): each conversation rendered as
  calibration renders it, each run of assistant tokens the continuation of everything before it.
  (The repo's ``corpora/`` are format samples written here, not traffic: a smoke test only.)

What this does not measure: what the served model would write. Its own greedy output decides
acceptance at run time; a gold patch is a human's fix, and the excerpts in the prompt are not
always the lines the patch quotes. No model weights are used and nothing runs on a GPU.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparkpack.calibrate.readers import read_corpus
from sparkpack.calibrate.render import ChatRenderer
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.chat_template import ChatTemplate
from sparkpack.runtime.drafting import NgramDrafter
from sparkpack.runtime.speculative import Speculation, speculative_tokens
from sparkpack.runtime.tokenizer import GGUFTokenizer

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)


class TeacherForced:
    """A session (what ``runtime.speculative.speculative_tokens`` drives) whose model writes
    ``target`` after ``context``: a plain step's logits and each verify row pick the target's
    token at that position. Counts the plain steps and the verifies by their number of drafts."""

    def __init__(self, context: list[int], target: list[int], max_k: int, min_n: int, max_n: int):
        self.fed = list(context)
        self.start, self.target, self.vocab = len(context), target, max(target) + 1
        self.draft = Speculation(NgramDrafter(max_n, min_n), max_k)
        self.plain_steps = 0
        self.verifies: Counter = Counter()
        self._verified = 0

    def logits(self, pos: int) -> torch.Tensor:
        """The logits after the first ``pos`` tokens: one-hot on the target's token there."""
        row = torch.zeros(self.vocab)
        row[self.target[pos - self.start]] = 1
        return row

    def feed(self, ids: list[int], side: str) -> torch.Tensor:
        self.plain_steps += 1
        self.fed = list(ids)
        return self.logits(len(self.fed))

    def verify(self, tokens: list[int]) -> tuple[torch.Tensor, None]:
        self.verifies[len(tokens) - 1] += 1
        self._verified = len(self.fed)
        self.fed.extend(tokens)
        return torch.stack([self.logits(self._verified + 1 + i) for i in range(len(tokens))]), None

    def keep(self, k: int) -> None:
        del self.fed[self._verified + k:]


@dataclass
class Replay:
    """The drafting loop's steps over a set of continuations: ``speculative_tokens`` itself, run
    on a ``TeacherForced`` session per continuation (greedy, as the runtime drafts)."""

    targets: int = 0
    tokens: int = 0
    plain_steps: int = 0
    verifies: Counter = field(default_factory=Counter)  # by number of drafts
    drafted: int = 0
    accepted: int = 0

    def add(self, context: list[int], target: list[int], max_k: int, min_n: int, max_n: int) -> None:
        s = TeacherForced(context, target, max_k, min_n, max_n)
        out = list(speculative_tokens(s, s.logits(len(context)), len(target), None))  # type: ignore[arg-type]
        assert out == target, "the drafting loop wrote other tokens than the target"
        self.plain_steps += s.plain_steps
        self.verifies += s.verifies
        self.drafted += s.draft.stats.drafted
        self.accepted += s.draft.stats.accepted
        self.targets += 1
        self.tokens += len(target)

    @property
    def steps(self) -> int:
        return self.plain_steps + sum(self.verifies.values())

    def speedup(self, costs: list[float]) -> float:
        """Plain decode's time for the tokens after each first over the replay's, at ``costs``
        (ms of a plain step, then of a verify of 1, 2, ... drafts)."""
        longest = max(self.verifies, default=0)
        if longest >= len(costs):
            raise SystemExit(f"ngram_acceptance: a verify of {longest} drafts has no cost in --step-ms "
                             f"(give {longest + 1} numbers: a plain step, then 1..{longest} drafts)")
        spent = self.plain_steps * costs[0] + sum(c * costs[d] for d, c in self.verifies.items())
        return (self.tokens - self.targets) * costs[0] / spent if spent else 1.0

    def break_even(self) -> float | None:
        """The verify cost, in plain steps, under which drafting decodes faster than plain steps
        (were a verify's cost the same whatever its drafts): the tokens the verifies took over the
        verifies. None where nothing was drafted."""
        n = sum(self.verifies.values())
        return (self.tokens - self.targets - self.plain_steps) / n if n else None

    def summary(self, costs: dict[str, list[float]]) -> dict:
        steps = self.steps
        return {"targets": self.targets, "tokens": self.tokens, "plain_steps": self.plain_steps,
                "verifies": {str(d): c for d, c in sorted(self.verifies.items())},
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_step": (self.tokens - self.targets) / steps if steps else 0.0,
                "drafting_share": sum(self.verifies.values()) / steps if steps else 0.0,
                "break_even": self.break_even(),
                "speedup": {label: self.speedup(c) for label, c in costs.items()}}


HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def patch_as_edits(patch: str) -> str:
    """A unified diff as an agent writes the same fix: one ``Edit`` tool call a hunk, its old
    string the hunk's context and removed lines, its new string the context and added ones. A
    hunk's lines are as many as its header counts (a line of code that starts like a file header,
    ``-- `` or ``++ ``, is still the hunk's)."""
    calls, path = [], None
    lines = patch.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("+++ "):
            path = line[4:].removeprefix("b/")
            continue
        m = HUNK.match(line)
        if not m:
            continue
        left, right = (int(c) if c is not None else 1 for c in m.groups())
        old: list[str] = []
        new: list[str] = []
        while (left or right) and i < len(lines):
            mark, text = lines[i][:1], lines[i][1:]
            i += 1
            if mark in (" ", ""):
                old.append(text)
                new.append(text)
                left, right = left - 1, right - 1
            elif mark == "-":
                old.append(text)
                left -= 1
            elif mark == "+":
                new.append(text)
                right -= 1
        args = {"file_path": path, "old_string": "\n".join(old), "new_string": "\n".join(new)}
        calls.append("<tool_call>\n" + json.dumps({"name": "Edit", "arguments": args}) + "\n</tool_call>")
    return "\n".join(calls)


def lucebox_pairs(root: Path, tok: GGUFTokenizer, chat: ChatTemplate) -> dict[str, list[Pair]]:
    """(prompt ids, fix ids) for every agent prompt whose issue is a SWE-bench Verified one, the
    fix as its gold patch and as edit calls."""
    import pyarrow.parquet as pq

    patches = dict(zip(*(pq.read_table(root / "swe_bench_verified.parquet", columns=["instance_id", "patch"])
                         .to_pydict()[c] for c in ("instance_id", "patch"))))
    diffs, edits = [], []
    for line in (root / "bench_agent.jsonl").read_text().splitlines():
        row = json.loads(line)
        text = "\n".join(m["content"] for m in row["messages"] if isinstance(m.get("content"), str))
        m = re.search(r"^Instance:\s*(\S+)", text, re.M)
        if m and m.group(1) in patches:
            prompt = tok.encode(chat.render(row["messages"], add_generation_prompt=True), add_special=True)
            diffs.append((prompt, tok.encode(patches[m.group(1)])))
            edits.append((prompt, tok.encode(patch_as_edits(patches[m.group(1)]))))
    return {"lucebox-hub gold patches, as diffs": diffs, "lucebox-hub gold patches, as edit calls": edits}


def corpus_pairs(path: Path, renderer: ChatRenderer) -> list[Pair]:
    """(everything before, the run) for each run of assistant tokens of each conversation."""
    convs, _ = read_corpus(path)
    out = []
    for conv in convs:
        r = renderer.render_or_reason(conv)
        if isinstance(r, str):
            continue
        gen, i = r.generated, 0
        while i < len(r.ids):
            if gen[i]:
                j = i
                while j < len(r.ids) and gen[j]:
                    j += 1
                out.append((r.ids[:i], r.ids[i:j]))
                i = j
            else:
                i += 1
    return out


def step_costs(spec: str) -> tuple[str, list[float]]:
    label, _, numbers = spec.partition("=")
    try:
        costs = [float(x) for x in numbers.split(",")]
    except ValueError:
        costs = []
    if not label or len(costs) < 2 or min(costs) <= 0:
        raise argparse.ArgumentTypeError(f"--step-ms wants LABEL=PLAIN,V1[,V2...] in positive ms, got {spec!r}")
    return label, costs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a GGUF: its tokenizer and chat template (no weights are read)")
    ap.add_argument("--lucebox", type=Path, help="lucebox-hub corpus folder (bench_agent.jsonl + SWE-bench patches)")
    ap.add_argument("--corpus", type=Path, action="append", default=[], help="a corpus repack calibrate reads")
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[4], help="the drafts' longest length (spark-run's)")
    ap.add_argument("--ngram", nargs="+", default=["1:3"], help="MIN:MAX n-gram lengths matched (the runtime's: 1:3)")
    ap.add_argument("--step-ms", type=step_costs, action="append", default=[],
                    help="LABEL=PLAIN,V1,V2,...: measured ms of a plain step and of verifies of 1, 2, ... drafts")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.lucebox is None and not a.corpus:
        ap.error("give --lucebox and/or --corpus")
    gguf = GGUFModel(a.model)
    tok = GGUFTokenizer.from_metadata(gguf)
    template = gguf.get("tokenizer.chat_template")
    if not template:
        ap.error(f"{a.model} has no chat template")
    chat = ChatTemplate.from_tokenizer(template, tok)
    synthetic = gguf.get("sparkpack.synthetic") is not None
    sources: dict[str, list[Pair]] = {}
    if a.lucebox is not None:
        sources.update(lucebox_pairs(a.lucebox, tok, chat))
    for c in a.corpus:
        sources[f"{c} (assistant turns)"] = corpus_pairs(c, ChatRenderer(tok, chat.render))
    costs = dict(a.step_ms)
    rows = []
    for name, pairs in sources.items():
        for spec in a.ngram:
            lo, hi = (int(x) for x in spec.split(":"))
            for k in a.draft_tokens:
                r = Replay()
                for context, target in pairs:
                    if target:
                        r.add(context, target, k, lo, hi)
                rows.append({"source": name, "ngram": spec, "draft_tokens": k, **r.summary(costs)})
    if a.json:
        print(json.dumps({"model": str(a.model), "synthetic_tokenizer": synthetic, "rows": rows}, indent=2))
        return 0
    if synthetic:
        print(f"note: {a.model} is a synthetic file: token counts are its small BPE's, not Qwen's", file=sys.stderr)
    print(f"{'source':<40} {'n-gram':>6} {'K':>2} {'targets':>7} {'tokens':>6} {'accept':>7} {'tok/step':>8} "
          f"{'drafting':>8} {'even at':>7}" + "".join(f" {label:>10}" for label in costs))
    for r in rows:
        print(f"{r['source']:<40} {r['ngram']:>6} {r['draft_tokens']:>2} {r['targets']:>7} {r['tokens']:>6} "
              f"{r['acceptance']:>7.1%} {r['tokens_per_step']:>8.2f} {r['drafting_share']:>8.1%} "
              + (f"{r['break_even']:>7.2f}" if r["break_even"] is not None else f"{'-':>7}")
              + "".join(f" {r['speedup'][label]:>9.2f}x" for label in costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
