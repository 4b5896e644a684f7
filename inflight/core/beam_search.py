"""Beam search, host side: the bookkeeping that picks beams (no torch; the device step that
proposes candidates is `inflight.sampling.beam_search`).

A beam request runs as `beam_width` rows (one per live beam) once its prompt is computed; the
prompt's row alone proposes the first candidates. Each step:
  1. device (`beam_candidates`): log_softmax of each beam row's processed logits (bias,
     penalties, bans, then temperature), plus the beam's cumulative log prob, ranked with
     TensorRT-LLM's diversity term (`beam_search_diversity_rate * beam index`); the best
     2 * beam_width (beam, token) pairs over all beams come back to the host in one copy;
  2. host (`BeamSearch.step`): candidates that end (end_id, a stop word, max_tokens) and rank
     within the first beam_width become finished hypotheses, scored cum_log_prob /
     generated_len ** length_penalty; the best beam_width candidates that do not end are the
     next live beams (a beam may have several children or none); `early_stopping` decides
     when the search is over.

Selection follows Hugging Face's `generate(num_beams=..., do_sample=False)` step for step
(its `_beam_search`), with TensorRT-LLM's parameters and defaults: length_penalty 0,
early_stopping 1 (= HF's True: stop once beam_width hypotheses are finished), 0 (= HF's
False: stop when no live beam can beat the worst finished one at its current length), > 1
(= HF's "never": with length_penalty > 0 that bound uses max_tokens). HF's defaults differ
(length_penalty 1.0, early_stopping False); both are explicit in requests that compare them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BeamRow:
    """What the sampler needs to know about a sampled row that is a beam (see SamplingRow.beam)."""

    group: int  # the request id: the rows of one request are consecutive in a step
    cum_log_prob: float  # the beam's cumulative log prob so far
    index: int  # beam index in its group (TensorRT-LLM's diversity term multiplies it)
    num_candidates: int  # 2 * beam_width
    diversity_rate: float = 0.0
    temperature: float = 1.0


@dataclass
class Candidates:
    """A group's best (beam, token) pairs, in rank order (the diversity term included)."""

    token_ids: list[int]
    parents: list[int]  # beam index of each candidate's parent
    cum_log_probs: list[float]  # parent's cum log prob + the token's log prob
    log_probs: list[float]  # the token's log prob


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (end_id excluded) and scores."""

    score: float  # cum_log_prob / generated_len ** length_penalty
    token_ids: list[int]
    cum_log_prob: float
    log_probs: list[float]
    ends_with_end_id: bool
    stopped: bool  # a stop word ended it


@dataclass
class Beam:
    """A live beam's generated tokens and log probs (the engine keeps its Sequence in step)."""

    token_ids: list[int]
    cum_log_prob: float = 0.0
    log_probs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Selection:
    """One step's outcome: live beam i continues beam parents[i] with token_ids[i]."""

    parents: list[int]
    token_ids: list[int]
    done: bool


class BeamSearch:
    """The host side of one request's beam search (no torch)."""

    def __init__(self, beam_width: int, max_new_tokens: int, length_penalty: float | None,
                 early_stopping: int | None, end_id: int | None, stop_words: list[list[int]] | None):
        self.beam_width = beam_width
        self.max_new_tokens = max_new_tokens
        self.length_penalty = 0.0 if length_penalty is None else float(length_penalty)
        self.early_stopping = 1 if early_stopping is None else int(early_stopping)
        self.end_id = end_id
        self.stop_words = stop_words or []
        self.beams: list[Beam] = [Beam([])]  # the prompt's row until the first step
        self.finished: list[Hypothesis] = []
        self.num_generated = 0
        self._improvable = True  # HF's is_early_stop_heuristic_unsatisfied (sticky)

    def _ends(self, tokens: list[int], token: int) -> tuple[bool, bool, bool]:
        """(ends, by end_id, by stop word) for a candidate `tokens + [token]`."""
        if token == self.end_id:
            return True, True, False
        seq = tokens + [token]
        stopped = any(len(w) <= len(seq) and seq[-len(w):] == w for w in self.stop_words)
        return stopped or len(seq) >= self.max_new_tokens, False, stopped

    def step(self, cand: Candidates) -> Selection:
        """Pick the next live beams from `cand` and record finished hypotheses."""
        width, length = self.beam_width, self.num_generated + 1
        ends = [self._ends(self.beams[p].token_ids, t) for p, t in zip(cand.parents, cand.token_ids)]
        all_full = len(self.finished) == width
        accept = self._improvable and not (all_full and self.early_stopping == 1)
        for rank, (p, t, cum, lp) in enumerate(zip(cand.parents, cand.token_ids, cand.cum_log_probs,
                                                   cand.log_probs)):
            if rank < width and ends[rank][0] and accept:
                parent = self.beams[p]
                tokens = parent.token_ids + ([] if ends[rank][1] else [t])
                self.finished.append(Hypothesis(cum / length ** self.length_penalty, tokens, cum,
                                                parent.log_probs + [lp], ends[rank][1], ends[rank][2]))
        # Stable: among equal scores the earlier entry (older hypothesis, better rank) stays.
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:width]
        live = [i for i, e in enumerate(ends) if not e[0]][:width]
        parents = [cand.parents[i] for i in live]
        tokens = [cand.token_ids[i] for i in live]
        old = self.beams
        self.beams = [Beam(old[p].token_ids + [t], cand.cum_log_probs[i], old[p].log_probs + [cand.log_probs[i]])
                      for i, p, t in zip(live, parents, tokens)]
        self.num_generated = length
        self._improvable = self._improvable and self._can_improve()
        done = (not self._improvable or not live
                or (len(self.finished) == width and self.early_stopping == 1))
        return Selection(parents, tokens, done)

    def _can_improve(self) -> bool:
        """HF's early-stop heuristic: may the best live beam still beat the worst finished one?"""
        if len(self.finished) < self.beam_width or not self.beams:
            return True
        if self.early_stopping not in (0, 1) and self.length_penalty > 0.0:
            best_length = self.max_new_tokens  # "never": the longest it could get
        else:
            best_length = self.num_generated
        best_live = max(b.cum_log_prob for b in self.beams) / best_length ** self.length_penalty
        return best_live > self.finished[-1].score

    def results(self, num_beams: int) -> list[Hypothesis]:
        """The best `num_beams` hypotheses, best first; live beams fill in if too few finished
        (a request cancelled or failed mid-way)."""
        hyps = list(self.finished)
        if len(hyps) < num_beams:
            length = max(self.num_generated, 1)
            hyps += sorted((Hypothesis(b.cum_log_prob / length ** self.length_penalty, b.token_ids,
                                       b.cum_log_prob, b.log_probs, False, False) for b in self.beams),
                           key=lambda h: -h.score)
        return hyps[:num_beams]
