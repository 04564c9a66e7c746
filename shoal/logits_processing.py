"""What a request's own settings do to its logits before a token is picked: repetition,
frequency and presence penalties, logit_bias, and min_tokens (stop tokens barred), as
OpenAI and vLLM define them. Batched over the rows that asked; rows that did not are left
alone, so greedy output is unchanged when none of these is set. Then, for the rows that
sample, the min-p, top-k and top-p filters, and the Gumbel noise they draw with. Apart
from the sampler, the log-probabilities a request may ask for (`compute_logprobs`: of the
raw logits, before any of the above).

The penalties need the tokens each request has produced. Those are counted on the device as
they are sampled (`TokenCounts`), so a step never waits for the previous step's tokens to
reach the host (the overlap loop samples step n+1 before step n's tokens are read back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.util import to_device


class TokenCounts:
    """Per request, how often each token id was produced ([vocab] int32) and which ids its
    prompt holds ([vocab] bool), as rows of two device slabs. Row 0 stays zero: the row of
    requests that keep no counts."""

    def __init__(self, vocab: int, device: torch.device, capacity: int = 8):
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(capacity, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)
        self._free = list(range(capacity - 1, 0, -1))
        self._rows: dict[str, int] = {}

    def row(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """The request's row; a new one is filled from its prompt."""
        row = self._rows.get(request_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._rows[request_id] = self._free.pop()
            self.counts[row].zero_()
            self.in_prompt[row].zero_()
            if prompt_token_ids:
                ids = to_device(prompt_token_ids, self.device)
                self.in_prompt[row].index_fill_(0, ids, True)
        return row

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """counts[rows[i], tokens[i]] += 1, on the device."""
        self.counts.index_put_((rows, tokens.long()), torch.ones_like(rows, dtype=torch.int32),
                               accumulate=True)

    def forget(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self._free.extend(range(2 * old - 1, old - 1, -1))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """Penalised copy of `logits` [R, vocab]. `counts` [R, vocab]: output tokens so far;
    `in_prompt` [R, vocab]. Repetition (HF/vLLM): a token seen in the prompt or the output
    has a positive logit divided by the penalty, a negative one multiplied. Frequency and
    presence (OpenAI): minus penalty x count, and minus penalty once if it occurred."""
    occurred = counts > 0
    rep = repetition[:, None]
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(occurred | in_prompt, scaled, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * occurred


def add_at(logits: torch.Tensor, rows: list[int], token_ids: list[int],
           values: list[float]) -> torch.Tensor:
    """logits[rows[i], token_ids[i]] += values[i], in place (one launch for all rows)."""
    if rows:
        device = logits.device
        logits.index_put_((to_device(rows, device), to_device(token_ids, device)),
                          to_device(values, device, logits.dtype), accumulate=True)
    return logits


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability is below min_p x the most likely token's set to -inf
    (rows with min_p 0 are unchanged)."""
    probs = logits.softmax(dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def top_k_top_p_filter(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Rows of `logits` with tokens outside each row's top k (0: all) and outside its top-p
    nucleus set to -inf. The nucleus keeps a token while the probability mass before it is
    below top_p (the most likely token always stays)."""
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    k = to_device([min(k, vocab) if k else vocab for k in top_k], logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    p = to_device(top_p, logits.device, probs.dtype)[:, None]
    drop |= (probs.cumsum(dim=-1) - probs >= p) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def signed64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 torch stores."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (signed64(0x9E3779B97F4A7C15), signed64(0xBF58476D1CE4E5B9),
                         signed64(0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def gumbel_noise(seeds: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float64 Gumbel noise, a pure function of (seed, draw, token id): a counter-
    based hash (splitmix64 finaliser) instead of a generator's state, so a request's draws
    are the same in any batch, on any device and on every TP rank. int64 products wrap."""
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = seeds[:, None] * _GOLDEN + draws[:, None] * _MIX1 + v[None, :]
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    u = (_shift_right(x, 11).double() + 0.5) * 2.0 ** -53  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model (log_softmax of the raw logits,
    before temperature, top-k and top-p) and the most likely tokens of that position."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; k entries
    rank: int = 0  # 1 + how many tokens are more likely (0: not computed)


def compute_logprobs(logits: torch.Tensor, token_ids: list[int],
                     num_top: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row of `logits` [N, vocab]: the logprobs of `token_ids[row]` and the top
    `num_top[row]` tokens, or None where the row's request did not ask (num_top None).
    Separate from the sampler: only the rows that asked are touched."""
    rows = [i for i, k in enumerate(num_top) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, vocab]
    sampled = torch.tensor([token_ids[i] for i in rows], device=logits.device)
    chosen_t = logp.gather(1, sampled[:, None])
    ranks = ((logp > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    k = max(num_top[i] for i in rows)
    top_values, top_ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = num_top[i]
        out[i] = TokenLogprobs(chosen[j], tuple(zip(top_ids[j][:n], top_values[j][:n])),
                               ranks[j])
    return out
