"""What the engine keeps about one beam search request, and how its beams become responses.

`BeamRequestState` is a `RequestState` whose sequence (the leader) grows `beam_width - 1`
sibling sequences after its prompt step. Each step the engine hands it the step's candidates
(`advance`): the host search (`inflight.sampling.beam_search.BeamSearch`) picks the live
beams, then every beam's sequence takes its parent's tokens and block table (the block
manager's fork with ref counts, copy-on-write of a shared partial block), so the prompt is
computed once and shared by all beams.

Overlapped steps: a beam group's next rows depend on the host's re-ranking of its last step,
so it sits out the step launched before that step's candidates are read (other requests go on
overlapping); synchronous engines schedule it every step.

Responses follow TensorRT-LLM: one row per beam in each response. Streaming sends, every step,
all the tokens each live beam has generated so far (its `returnAllGeneratedTokens`, forced on
for beam search: beams are re-ranked, so deltas would not add up); the final response has the
best `num_return_sequences` (default beam_width) hypotheses, best first, with their
cum_log_probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.api.types import FinishReason, Response, Result
from inflight.core.beam_search import BeamRow, BeamSearch, Candidates, Hypothesis
from inflight.core.block_manager import BlockManager
from inflight.core.sequence import Sequence, SequenceStatus
from inflight.engine.request_state import RequestState
from inflight.sampling.row import SamplingRow


@dataclass(eq=False)
class BeamRequestState(RequestState):
    """A beam search request (beam_width > 1); the leader `seq` heads the beam group."""

    search: BeamSearch | None = field(default=None)
    is_beam = True

    def __post_init__(self) -> None:
        super().__post_init__()
        sc, request = self.sampling, self.request
        end_id = request.end_id if request.end_id is not None and request.end_id >= 0 else None
        self.search = BeamSearch(sc.beam_width, request.max_tokens, sc.length_penalty,
                                 sc.early_stopping, end_id, request.stop_words)

    def beam_row(self, seq: Sequence) -> SamplingRow:
        """Beam `seq`'s row this step: the processors of a plain row, its beam's score."""
        sc, request = self.sampling, self.request
        index = self.seq.group.index(seq) if seq is not self.seq else 0
        beam = self.search.beams[index]
        temperature = sc.temperature if sc.temperature else 1.0  # 0 / unset: no scaling
        return SamplingRow(
            token_ids=seq.token_ids,
            num_prompt_tokens=self.seq.num_prompt_tokens,
            repetition_penalty=sc.repetition_penalty or 1.0,
            presence_penalty=sc.presence_penalty or 0.0,
            frequency_penalty=sc.frequency_penalty or 0.0,
            min_tokens=sc.min_tokens or 0,
            end_id=self.search.end_id,
            bad_words=request.bad_words or [],
            embedding_bias=self.embedding_bias,
            beam=BeamRow(self.request_id, beam.cum_log_prob, index, 2 * sc.beam_width,
                         sc.beam_search_diversity_rate or 0.0, temperature),
        )

    def add_placeholder(self, sampled_row: int) -> None:
        # No placeholder: the beams have no uncomputed token until `advance` re-ranks them, so
        # an overlapped engine does not schedule them in the step launched meanwhile.
        pass

    def drop_placeholder(self) -> None:
        pass

    def advance(self, candidates: Candidates, block_manager: BlockManager) -> list[tuple[int, int]]:
        """One beam search step: picks the live beams, re-arranges their sequences and blocks.
        Returns the KV block copies to make before the next step; sets `finish_reason` when
        the search is over."""
        selection = self.search.step(candidates)
        if selection.done:
            best = self.search.results(1)[0]
            self.finish_reason = _reason(best)
            return []
        leader = self.seq
        old = leader.group
        old_tokens = [list(beam.token_ids) for beam in old]
        while len(leader.beam_siblings) + 1 < len(selection.parents):
            leader.beam_siblings.append(Sequence(
                request_id=leader.request_id, prompt_token_ids=leader.prompt_token_ids,
                max_new_tokens=leader.max_new_tokens, num_computed_tokens=leader.num_computed_tokens,
                num_cached_tokens=leader.num_cached_tokens, status=SequenceStatus.RUNNING,
                beam_width=leader.beam_width))
        beams = leader.group
        copies = block_manager.reassign_beams(beams, selection.parents)
        del leader.beam_siblings[len(selection.parents) - 1:]  # beams left without a continuation
        for beam, parent, token in zip(beams, selection.parents, selection.token_ids):
            beam.token_ids = old_tokens[parent] + [token]
        return copies

    # ----- responses out -------------------------------------------------------------------

    def response(self, is_final: bool, is_sequence_final: bool | None = None) -> Response:
        request = self.request
        num_beams = self.sampling.num_return_sequences or self.sampling.beam_width
        if is_final:
            hyps = self.search.results(num_beams)
        else:
            hyps = [Hypothesis(0.0, b.token_ids, b.cum_log_prob, b.log_probs, False, False)
                    for b in self.search.beams[:num_beams]]
        prompt = [] if request.streaming or request.output_config.exclude_input_from_output \
            else list(self.seq.prompt_token_ids)
        cancelled = self.finish_reason is FinishReason.CANCELLED
        reasons = [FinishReason.NOT_FINISHED if not is_final else
                   FinishReason.CANCELLED if cancelled else _reason(h) for h in hyps]
        want_log_probs = request.output_config.return_log_probs
        result = Result(
            is_final=is_final,
            output_token_ids=[prompt + list(h.token_ids) for h in hyps],
            cum_log_probs=[h.cum_log_prob for h in hyps] if want_log_probs else None,
            log_probs=[list(h.log_probs) for h in hyps] if want_log_probs else None,
            finish_reasons=reasons,
            is_sequence_final=is_final,
            num_input_tokens=self.seq.num_prompt_tokens,
            num_output_tokens=len(hyps[0].token_ids) if hyps else 0,
        )
        return Response(request_id=self.request_id, result=result, client_id=request.client_id)


def _reason(hyp: Hypothesis) -> FinishReason:
    if hyp.ends_with_end_id:
        return FinishReason.END_ID
    return FinishReason.STOP_WORDS if hyp.stopped else FinishReason.LENGTH
