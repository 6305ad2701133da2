"""Sampler semantics: greedy, the filters, repetition penalty and seeded reproducibility."""
from __future__ import annotations

import pytest
import torch

from sparkpack.formats.errors import SparkpackError
from sparkpack.runtime.sampling import Sampler


def _logits(seed: int = 0, n: int = 50) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    for s in range(5):
        x = _logits(s)
        assert Sampler().sample(x) == int(torch.argmax(x))
    batch = torch.stack([_logits(1), _logits(2)])
    assert torch.equal(Sampler().sample(batch), torch.argmax(batch, dim=-1))


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_filters_that_leave_one_token_are_greedy(kw):
    x = _logits(3)
    s = Sampler(temperature=1.5, seed=0, **kw)
    assert {s.sample(x) for _ in range(30)} == {int(torch.argmax(x))}


def test_top_k_keeps_exactly_k():
    x = _logits(4)
    kept = torch.isfinite(Sampler(temperature=1.0, top_k=5).filtered_logits(x.unsqueeze(0))[0])
    assert kept.sum() == 5 and set(kept.nonzero().flatten().tolist()) == set(torch.topk(x, 5).indices.tolist())


def test_top_p_keeps_smallest_set_reaching_p():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(Sampler(temperature=1.0, top_p=0.7).filtered_logits(x.unsqueeze(0))[0])
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(Sampler(temperature=1.0, top_p=0.9).filtered_logits(x.unsqueeze(0))[0])
    assert kept.tolist() == [True, True, True, False]


def test_min_p_relative_to_top_token():
    x = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03]))
    kept = torch.isfinite(Sampler(temperature=1.0, min_p=0.25).filtered_logits(x.unsqueeze(0))[0])
    assert kept.tolist() == [True, True, True, False, False]  # threshold 0.1
    s = Sampler(temperature=1.0, min_p=0.25, seed=1)
    assert {s.sample(x) for _ in range(300)} == {0, 1, 2}


def test_empirical_distribution_matches_softmax():
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    t = 0.8
    s = Sampler(temperature=t, seed=1234)
    n = 20000
    batch = x.expand(n, -1)
    draws = s.sample(batch)
    freq = torch.bincount(draws, minlength=5).float() / n
    expected = torch.softmax(x / t, dim=-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_repetition_penalty_changes_argmax():
    x = torch.tensor([3.0, 2.5, -1.0, -0.5])
    assert Sampler().sample(x) == 0
    s = Sampler(repetition_penalty=1.5)
    assert s.sample(x, [0]) == 1  # 3.0 / 1.5 = 2.0 < 2.5
    pen = Sampler(repetition_penalty=1.5, temperature=1.0).filtered_logits(x.unsqueeze(0), [2, 2, 0])[0]
    assert pen.tolist() == [2.0, 2.5, -1.5, -0.5]  # negative logits are multiplied
    assert Sampler(repetition_penalty=1.5).sample(x, torch.tensor([0])) == 1


def test_same_seed_same_sequence():
    x = _logits(7)
    a = Sampler(temperature=1.0, top_k=20, top_p=0.95, seed=42)
    b = Sampler(temperature=1.0, top_k=20, top_p=0.95, seed=42)
    c = Sampler(temperature=1.0, top_k=20, top_p=0.95, seed=43)
    seq_a = [a.sample(x) for _ in range(40)]
    assert seq_a == [b.sample(x) for _ in range(40)]
    assert seq_a != [c.sample(x) for _ in range(40)]
    assert len(set(seq_a)) > 1


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    """OpenAI's rule, ``count * frequency + (count > 0) * presence`` off each logit, where the
    counts are over the tokens after the prompt (the first ``prompt_len`` of the history)."""
    x = torch.tensor([3.0, 2.5, 1.0, -0.5])
    s = Sampler(presence_penalty=0.5, frequency_penalty=0.25, prompt_len=2)
    pen = Sampler(presence_penalty=0.5, frequency_penalty=0.25, prompt_len=2,
                  temperature=1.0).filtered_logits(x.unsqueeze(0), [0, 1, 2, 2, 0])[0]  # prompt 0, 1; generated 2, 2, 0
    assert pen.tolist() == [3.0 - 0.25 - 0.5, 2.5, 1.0 - 0.5 - 0.5, -0.5]
    assert s.sample(x, [0, 1]) == 0 and Sampler(presence_penalty=2.0).sample(x, [0]) == 1
    assert Sampler(frequency_penalty=-1.0).sample(x, [3, 3, 3, 3]) == 3  # negative values encourage
    assert not s.history_free and Sampler(temperature=1.0).history_free
    both = Sampler(repetition_penalty=2.0, presence_penalty=1.0, temperature=1.0)  # repetition first, then presence
    assert both.filtered_logits(x.unsqueeze(0), [0])[0].tolist() == [0.5, 2.5, 1.0, -0.5]


def test_seeded_draws_depend_on_the_seed_only():
    """Each request builds its own sampler: its seed alone fixes its draws."""
    x = _logits(9)
    draws = [Sampler(temperature=1.0, seed=s).sample(x) for s in (1, 2, 1)]
    assert draws[0] == draws[2]
    assert len({Sampler(temperature=1.0, seed=s).sample(x) for s in range(30)}) > 1


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5},
                                {"min_p": 2.0}, {"repetition_penalty": 0.0}, {"presence_penalty": 2.5},
                                {"frequency_penalty": -3.0}])
def test_bad_settings_rejected(kw):
    with pytest.raises(SparkpackError, match=next(iter(kw))):
        Sampler(**kw)


def test_zero_top_p_through_spark_run(tiny_hf_gguf, monkeypatch, capsys):
    """The one sampler setting click's ranges let through reaches the user as one line."""
    import sys

    from sparkpack.runtime import cli

    gguf = tiny_hf_gguf("qwen3moe")[1]
    capsys.readouterr()  # drop the fixture's progress output
    monkeypatch.setattr(sys, "argv", ["spark-run", str(gguf), "-p", "hi", "--top-p", "0", "--max-tokens", "2"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 1
    assert err == "spark-run: error: top_p must be in (0, 1], got 0.0\n"
