"""How much of a real agent continuation prompt-lookup drafting (``runtime.ngram_draft``) guesses.

    python bench/ngram_acceptance.py MODEL.gguf --lucebox ../shared/corpora/lucebox-hub \
        [--corpus corpora/] [--k 2 4 8] [--ngram 2:4 3:5 1:3] [--json]

Teacher-forced: the continuation is fixed text, replayed token by token. Before each verify step
the drafter proposes up to ``k`` tokens from the context so far; a greedy verify would keep the
longest prefix that equals the text, plus one token of its own; the context then grows by those
tokens. Counted: verify steps, tokens, drafted and accepted tokens. Reported: acceptance
(accepted / drafted), tokens per verify step (the speedup if a verify step cost a plain decode
step: an upper bound; the verify cost is measured by the decode benchmarks) and the share of
steps that had a draft at all.

Targets:

* ``--lucebox DIR``: lucebox-hub's agent prompts (``bench_agent.jsonl``: a coding agent's system
  prompt and a user turn holding a real SWE-bench Verified issue and the files it read), rendered
  with the model's chat template, and as the continuation the human-written fix of that issue
  (the gold ``patch`` of the same instance in ``swe_bench_verified.parquet``), as the agent would
  write it out.
* ``--corpus PATH`` (any corpus ``repack calibrate`` reads; ``corpora/`` holds real Claude Code
  and Codex sessions): each conversation rendered as calibration renders it, each run of
  assistant tokens the continuation of everything before it.

What this does not measure: what the served model would write. A model's own greedy output
decides acceptance at run time; a gold patch is a human's text in unified-diff form, where an
agent's edit tool call quotes old and new code (usually copying more of what it read). The token
units are the model file's tokenizer: on a synthetic file (``repack synth``) its small BPE splits
text into more, shorter tokens than Qwen's, so matches run longer in tokens; the script says so.
No model weights are used and nothing runs on a GPU.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sparkpack.calibrate.readers import read_corpus
from sparkpack.calibrate.render import ChatRenderer
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.chat_template import ChatTemplate
from sparkpack.runtime.ngram_draft import NgramIndex, accepted_prefix
from sparkpack.runtime.tokenizer import GGUFTokenizer


@dataclass
class Tally:
    targets: int = 0
    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    drafting_steps: int = 0

    def add(self, context: list[int], target: list[int], k: int, max_n: int, min_n: int) -> None:
        d = NgramIndex(max_n, min_n)
        d.extend(context)
        at = 0
        while at < len(target):
            draft = d.propose(k)
            kept = accepted_prefix(draft, target[at:])
            took = min(kept + 1, len(target) - at)  # the accepted drafts and the verify's own token
            d.extend(target[at:at + took])
            at += took
            self.steps += 1
            self.drafted += len(draft)
            self.accepted += kept
            self.drafting_steps += bool(draft)
        self.targets += 1
        self.tokens += len(target)

    def summary(self) -> dict:
        return {**asdict(self), "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_step": self.tokens / self.steps if self.steps else 0.0,
                "drafting_share": self.drafting_steps / self.steps if self.steps else 0.0}


def lucebox_pairs(root: Path, tok: GGUFTokenizer, chat: ChatTemplate) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, gold patch ids) for every agent prompt whose issue is a SWE-bench Verified one."""
    import pyarrow.parquet as pq

    patches = dict(zip(*(pq.read_table(root / "swe_bench_verified.parquet", columns=["instance_id", "patch"])
                         .to_pydict()[c] for c in ("instance_id", "patch"))))
    out = []
    for line in (root / "bench_agent.jsonl").read_text().splitlines():
        row = json.loads(line)
        text = "\n".join(m["content"] for m in row["messages"] if isinstance(m.get("content"), str))
        m = re.search(r"^Instance:\s*(\S+)", text, re.M)
        if m and m.group(1) in patches:
            prompt = chat.render(row["messages"], add_generation_prompt=True)
            out.append((tok.encode(prompt, add_special=True), tok.encode(patches[m.group(1)])))
    return out


def corpus_pairs(path: Path, renderer: ChatRenderer) -> list[tuple[list[int], list[int]]]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a GGUF: its tokenizer and chat template (no weights are read)")
    ap.add_argument("--lucebox", type=Path, help="lucebox-hub corpus folder (bench_agent.jsonl + SWE-bench patches)")
    ap.add_argument("--corpus", type=Path, action="append", default=[], help="a corpus repack calibrate reads")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="most tokens drafted per step")
    ap.add_argument("--ngram", nargs="+", default=["2:4"], help="MIN:MAX n-gram lengths matched")
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
    sources: dict[str, list[tuple[list[int], list[int]]]] = {}
    if a.lucebox is not None:
        sources["lucebox-hub (gold patches)"] = lucebox_pairs(a.lucebox, tok, chat)
    for c in a.corpus:
        sources[f"{c} (assistant turns)"] = corpus_pairs(c, ChatRenderer(tok, chat.render))
    rows = []
    for name, pairs in sources.items():
        for spec in a.ngram:
            lo, hi = (int(x) for x in spec.split(":"))
            for k in a.k:
                t = Tally()
                for context, target in pairs:
                    t.add(context, target, k, hi, lo)
                rows.append({"source": name, "ngram": spec, "k": k, **t.summary()})
    if a.json:
        print(json.dumps({"model": str(a.model), "synthetic_tokenizer": synthetic, "rows": rows}, indent=2))
        return 0
    if synthetic:
        print(f"note: {a.model} is a synthetic file: token counts are its small BPE's, not Qwen's", file=sys.stderr)
    print(f"{'source':<34} {'n-gram':>6} {'k':>3} {'targets':>7} {'tokens':>8} {'accept':>7} {'tok/step':>8} "
          f"{'drafting':>8}")
    for r in rows:
        print(f"{r['source']:<34} {r['ngram']:>6} {r['k']:>3} {r['targets']:>7} {r['tokens']:>8} "
              f"{r['acceptance']:>7.1%} {r['tokens_per_step']:>8.2f} {r['drafting_share']:>8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
