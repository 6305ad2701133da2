"""``MtpDrafter`` keeps the MTP head in step with the main sequence: through a drafting loop's
verify steps (rejected drafts, accepted runs, the kept rows handed over), a second proposal
without new rows, a session that kept a prefix, and a cut back
to an earlier turn, its drafts are those of the head run afresh over the sequence so far
(``MTPHead.forward`` over every pair at once, then ``MTPHead.draft``), on a float64 tiny model
where only a tie could make two summation orders pick different tokens."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from sparkpack.formats.errors import SparkpackError
from sparkpack.repack.synth import write_synthetic
from sparkpack.repack.synth.presets import get_preset
from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.models import StoreOptions, load_model
from sparkpack.runtime.models.mtp import MtpDrafter
from sparkpack.runtime.speculative import Speculation
from tests.commands import drafted_stats
from tests.marks import quick_first
from tests.serve_proc import replies_and_metrics

TINY = get_preset("qwen35moe", "tiny")
K = 3
DEVICE = os.environ.get("SPARKPACK_TEST_DEVICE", "cpu")  # the loop's run on a GPU: cuda


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("mtpd") / "m.gguf", "qwen35moe", "tiny", "Q8_0", seed=3,
                           mtp=True, skew=1.0)


@pytest.fixture(scope="module")
def model(mtp_path):
    return load_model(mtp_path, dtype=torch.float64)


def trunk_rows(model, ids: list[int]) -> torch.Tensor:
    """The trunk's output-normed rows of ``ids``' positions, as the loop hands them over."""
    return model.forward_hidden(ids)[1]


def fresh_drafts(model, seq: list[int], k: int, paired_with: list[int] | None = None, start: int = 0) -> list[int]:
    """The head run afresh: trunk rows ``start .. n - 2`` of ``seq`` (output-normed, from
    ``forward_hidden``) paired with the token after each (``paired_with`` overrides those tokens),
    then ``k - 1`` drafts fed back."""
    head = model.load_mtp()
    _, h = model.forward_hidden(seq[:-1])
    cache = head.new_cache()
    logits, hh = head.forward((paired_with or seq)[start + 1:], h[start:], cache)
    first = int(logits[-1].argmax())
    return [first] + head.draft(first, hh[-1:], cache, k - 1)


def test_drafts_stay_in_step_through_verify_steps(model) -> None:
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, TINY.n_vocab, (9,), generator=g).tolist()
    drafter = MtpDrafter(model)
    seq = prompt + [int(model.forward(prompt)[-1].argmax())]
    hidden = trunk_rows(model, prompt)
    accepted = [0, 2, 3, 1, 0, 3]  # how many of each round's drafts the (scripted) verify keeps
    for m in accepted:
        drafts = drafter.propose(seq, K, hidden)
        assert drafts == fresh_drafts(model, seq, K)
        assert drafter.paired == len(seq) - 1
        assert drafter.propose(seq, K, None) == drafts  # asked again with nothing new fed
        rows = trunk_rows(model, seq + drafts)[len(seq) - 1:]  # the verify's rows: last token + drafts
        bonus = (drafts[m] + 1) % TINY.n_vocab if m < len(drafts) else int(torch.randint(TINY.n_vocab, (1,), generator=g))
        seq = seq + drafts[:m] + [bonus]
        drafter.rewind(len(seq) - 1)  # the main cache keeps the last token and the accepted drafts
        hidden = rows[:m + 1]  # the kept rows only
    assert drafter.propose(seq, K, hidden) == fresh_drafts(model, seq, K)


def test_a_kept_prefix_and_a_cut_back(model) -> None:
    """A session that kept a prefix feeds the rest only: the head's context starts at the rows it
    is given. Cut back to an earlier turn, the head keeps its pairs before the cut and the pair at
    it (whose trunk row is gone), and pairs the new rows after."""
    g = torch.Generator().manual_seed(12)
    seq = torch.randint(0, TINY.n_vocab, (16,), generator=g).tolist()
    kept = 6  # positions the session did not recompute
    drafter = MtpDrafter(model)
    drafts = drafter.propose(seq, K, trunk_rows(model, seq[:-1])[kept:])
    assert drafts == fresh_drafts(model, seq, K, start=kept)
    cut = 11  # the conversation goes back to 11 fed positions, then on with other tokens
    new = seq[:cut + 1] + torch.randint(0, TINY.n_vocab, (5,), generator=g).tolist()
    new[cut] = (seq[cut] + 1) % TINY.n_vocab
    drafter.rewind(cut)
    assert drafter.paired == cut
    got = drafter.propose(new, K, trunk_rows(model, new[:-1])[cut:])
    assert got == fresh_drafts(model, new, K, paired_with=seq[:cut + 1] + new[cut + 1:], start=kept)
    drafter.rewind(kept - 1)  # before its context began: it starts over with the next rows
    assert drafter.paired == 0 and drafter.propose(new, K, None) == []
    assert drafter.propose(new, K, trunk_rows(model, new[:-1])) == fresh_drafts(model, new, K)


def test_rows_that_never_came_are_skipped(model) -> None:
    """Rows end at the position before the picked token; where some never came, the head's
    context goes on without them. Rows for more positions than the sequence has draft nothing."""
    seq = list(range(1, 9))
    drafter = MtpDrafter(model)
    drafter.propose(seq, K, trunk_rows(model, seq[:-1]))
    seq += [5, 6]  # two tokens more, but the row of only the last position
    rows = trunk_rows(model, seq[:-1])
    got = drafter.propose(seq, K, rows[8:])
    head = model.load_mtp()
    cache = head.new_cache()
    head.forward(seq[1:8], rows[:7], cache)
    logits, h = head.forward(seq[9:], rows[8:], cache)
    first = int(logits[-1].argmax())
    assert got == [first] + head.draft(first, h[-1:], cache, K - 1)
    assert drafter.propose(seq, 0, None) == []
    assert MtpDrafter(model).propose(seq[:3], K, rows[:5]) == []


def test_a_file_without_a_head_has_no_drafter(tmp_path: Path) -> None:
    plain = load_model(write_synthetic(tmp_path / "p.gguf", "qwen35moe", "tiny", "Q8_0", seed=3))
    with pytest.raises(SparkpackError, match="no multi-token-prediction head"):
        MtpDrafter(plain)


@pytest.mark.parametrize("hot_fraction", quick_first([None, 1.0, 0.6, 0.1]))
def test_greedy_run_with_mtp_drafts_gives_the_plain_tokens(mtp_path, hot_fraction) -> None:
    """Through the speculative loop (``runtime.speculative``) with the head's drafts, without the
    expert store and at full and partial residency: the plain greedy tokens, and the drafter
    still in step with the sequence at the end (its next drafts are the head's run afresh)."""
    store = None if hot_fraction is None else StoreOptions(hot_fraction=hot_fraction, miss_mode="async",
                                                           cache_slots=2, mtp=True)
    model = load_model(mtp_path, device=DEVICE, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32,
                       store=store)
    prompt = [5, 17, 23, 42, 8, 5, 17, 61, 3]
    plain = list(generate(model, None, prompt, None, 10, stop_ids=()))
    drafter = MtpDrafter(model)
    session = Session(model)
    session.draft = Speculation(drafter, 3)
    assert list(generate(model, None, prompt, None, 10, stop_ids=(), session=session)) == plain
    stats = session.draft.stats
    assert stats.verify_steps > 0 and stats.drafted > 0
    assert drafter.paired == session.draft.pending_from  # every row handed over was paired
    tokens = list(session.fed) + [7]  # the rows not yet handed over, and a next token
    got = drafter.propose(tokens, 3, session.draft.hidden())
    assert drafter.paired == len(tokens) - 1 and got == fresh_drafts(model, tokens, 3)


PROMPT_TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"


@pytest.mark.parametrize("residency", quick_first([[], ["--hot-fraction", "0.6"], ["--hot-fraction", "0.1"]]))
def test_spark_run_draft_mtp_gives_the_plain_reply(mtp_path, monkeypatch, capsys, tmp_path, residency) -> None:
    """``spark-run --draft mtp`` on a file with the head prints the plain greedy reply, and its
    stats report the head's drafting."""
    base = [str(mtp_path), "--raw", "-p", PROMPT_TEXT, "--temperature", "0", "--max-tokens", "10", *residency]
    draft = drafted_stats(base, "mtp", 2, tmp_path / "stats.json", monkeypatch, capsys)
    assert draft["drafter"] == "mtp" and draft["verify_steps"] > 0 and draft["drafted"] > 0


@pytest.mark.slow
def test_server_draft_mtp_gives_the_plain_reply(mtp_path) -> None:
    """Through a real server and the official OpenAI client: ``--draft mtp`` answers with the plain
    server's greedy reply, and ``/metrics`` counts its verify steps."""
    replies, metrics = replies_and_metrics(mtp_path, [[], ["--draft", "mtp", "--draft-tokens", "2"]], lambda s: s.openai(
        ).completions.create(model="x", prompt=PROMPT_TEXT, max_tokens=10, temperature=0).choices[0].text)
    assert replies[0] == replies[1]
    steps = re.search(r"^sparkpack_draft_verify_steps_total (\S+)$", metrics, re.M)
    assert steps and float(steps.group(1)) > 0
