"""Next-token choice from logits: greedy or seeded sampling with the usual filters.

Order (transformers' default warper order): repetition penalty -> temperature -> top-k -> top-p ->
min-p -> draw. Each step follows transformers' semantics, which llama.cpp's samplers share:

* repetition penalty: for every distinct token already in ``history``, a positive logit is divided
  by the penalty and a negative one multiplied (so the token always becomes less likely);
* presence and frequency penalties (OpenAI's, applied after the repetition penalty as vLLM does):
  ``presence * (count > 0) + frequency * count`` is subtracted from each logit, ``count`` being the
  token's occurrences among the generated tokens (``history`` after its first ``prompt_len``): a
  coding agent's 20k-token prompt would otherwise penalise nearly every common token;
* temperature 0 means greedy: argmax after the penalty, first index on ties;
* top-k keeps the k highest logits (ties with the k-th are kept);
* top-p keeps the smallest set of most likely tokens whose probability sums to at least ``top_p``
  (always at least one);
* min-p drops tokens whose probability is below ``min_p`` times the most likely one's.

Draws use one ``torch.Generator`` per device seeded from ``seed``, so the same seed on the same
device gives the same tokens (a fresh ``Sampler`` restarts the sequence).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from sparkpack.formats.errors import SparkpackError

History = Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | None


class Sampler:
    """Settings are checked here, so a bad command-line value is a one-line user error."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, seed: int | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, prompt_len: int = 0):
        if temperature < 0:
            raise SparkpackError(None, f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise SparkpackError(None, f"top_k must be >= 0 (0 = off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise SparkpackError(None, f"top_p must be in (0, 1], got {top_p}")
        if not 0.0 <= min_p <= 1.0:
            raise SparkpackError(None, f"min_p must be in [0, 1], got {min_p}")
        if repetition_penalty <= 0:
            raise SparkpackError(None, f"repetition_penalty must be > 0, got {repetition_penalty}")
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not -2.0 <= value <= 2.0:
                raise SparkpackError(None, f"{name} must be in [-2, 2], got {value}")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.prompt_len = int(prompt_len)
        self.seed = seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(str(device))
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[str(device)] = g
        return g

    def _penalise(self, logits: torch.Tensor, history: History) -> torch.Tensor:
        counted = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        if (self.repetition_penalty == 1.0 and not counted) or history is None or len(history) == 0:
            return logits
        rows = logits.shape[0]
        if isinstance(history, torch.Tensor):
            hist = [history.reshape(-1).tolist()] * rows if history.dim() == 1 else history.tolist()
        elif isinstance(history[0], (list, tuple, torch.Tensor)):
            hist = [list(h) for h in history]
        else:
            hist = [list(history)] * rows
        if len(hist) != rows:
            raise ValueError(f"history has {len(hist)} rows for {rows} rows of logits")
        out = logits.clone()
        for r, h in enumerate(hist):
            if h and self.repetition_penalty != 1.0:
                idx = torch.tensor(sorted(set(int(t) for t in h)), device=logits.device, dtype=torch.long)
                vals = out[r, idx]
                out[r, idx] = torch.where(vals < 0, vals * self.repetition_penalty, vals / self.repetition_penalty)
            generated = [int(t) for t in h[self.prompt_len:]]
            if counted and generated:
                idx, count = torch.tensor(generated, device=logits.device, dtype=torch.long).unique(return_counts=True)
                out[r, idx] -= self.frequency_penalty * count.to(out.dtype) + self.presence_penalty
        return out

    def filtered_logits(self, logits: torch.Tensor, history: History = None) -> torch.Tensor:
        """``[batch, vocab]`` float32 logits after penalty, temperature and the three filters
        (removed tokens are -inf); what ``sample`` draws from. Not used for greedy."""
        x = self._penalise(logits.float(), history)
        x = x / self.temperature
        neg_inf = torch.tensor(float("-inf"), device=x.device)
        if 0 < self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = torch.where(x < kth, neg_inf, x)
        if self.top_p < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
            drop_sorted = before >= self.top_p
            drop_sorted[..., 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        if self.min_p > 0.0:
            probs = torch.softmax(x, dim=-1)
            top = probs.max(dim=-1, keepdim=True).values
            x = x.masked_fill(probs < self.min_p * top, float("-inf"))
        return x

    @property
    def history_free(self) -> bool:
        """Whether a draw needs no token history (no penalty): then ``pick`` can run on the device
        one step ahead of the host (``Session.decode``)."""
        return self.repetition_penalty == 1.0 and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0

    def pick(self, logits: torch.Tensor, history: History = None) -> torch.Tensor:
        """Token ids as a tensor on ``logits``' device (a 0-d tensor for ``[vocab]`` logits), with
        no host round trip: what ``sample`` returns, before it is read."""
        single = logits.dim() == 1
        x = logits.unsqueeze(0) if single else logits
        if self.temperature == 0.0:
            out = torch.argmax(self._penalise(x.float(), history), dim=-1)
        else:
            probs = torch.softmax(self.filtered_logits(x, history), dim=-1)
            out = torch.multinomial(probs, 1, generator=self._generator(x.device)).squeeze(-1)
        return out[0] if single else out

    def verify_draft(self, logits: torch.Tensor, token: int, history: History = None) -> int | None:
        """Judge a drafted ``token`` against the main model's ``[vocab]`` logits at its position:
        None when it is kept, else the token drawn in its place. The rule of Leviathan et al.
        (2023) for a drafter that proposes one token with certainty (``runtime.drafting``: its
        proposal distribution q is one-hot): keep it with probability ``min(1, p(t) / q(t)) =
        p(t)``, else draw from the residual ``max(0, p - q)`` normalized, which is p without t.
        Why the output keeps p's distribution: a token s != t comes out only from the residual,
        with probability (1 - p(t)) * p(s) / (1 - p(t)) = p(s); t comes out with p(t). p is what
        ``sample`` draws from (penalties, temperature and filters applied); at temperature 0 it is
        the argmax, kept exactly when it is the draft."""
        if self.temperature == 0.0:
            best = int(self.pick(logits, history))
            return None if best == int(token) else best
        p = torch.softmax(self.filtered_logits(logits.unsqueeze(0), history), dim=-1)[0]
        g = self._generator(logits.device)
        if float(torch.rand((), generator=g, device=logits.device)) < float(p[token]):
            return None
        rest = p.clone()
        rest[token] = 0.0
        return int(torch.multinomial(rest / rest.sum(), 1, generator=g))

    def sample(self, logits: torch.Tensor, history: History = None) -> int | torch.Tensor:
        """One token id for ``[vocab]`` logits (an int), one per row for ``[batch, vocab]`` (a tensor)."""
        out = self.pick(logits, history)
        return int(out) if logits.dim() == 1 else out
