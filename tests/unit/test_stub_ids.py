"""The engine id <-> stub id map shared by the engine process and the in-stub engine."""

from __future__ import annotations

from inflight.api.types import FinishReason, Response, Result
from inflight.serving.stub_ids import StubIds


def _response(engine_id, final=False, error=None):
    if error:
        return Response(engine_id, error_msg=error)
    return Response(engine_id, result=Result(is_final=final, output_token_ids=[[1]],
                                             finish_reasons=[FinishReason.NOT_FINISHED]))


def test_responses_are_routed_by_stub_id_until_their_request_ends():
    ids = StubIds()
    ids.add(engine_id=7, stub_id=101)
    ids.add(engine_id=8, stub_id=102)
    routed = ids.route([_response(7), _response(99), _response(8, error="boom"), _response(7, final=True)])
    assert [(stub_id, r.request_id) for stub_id, r in routed] == [(101, 7), (102, 8), (101, 7)]
    assert len(ids) == 0 and ids.engine_id(101) is None
    assert ids.route([_response(7)]) == []  # ended: a late response goes nowhere


def test_forget_undoes_an_admission():
    ids = StubIds()
    ids.add(3, 30)
    assert ids.engine_id(30) == 3
    ids.forget(3)
    ids.forget(3)  # twice is harmless
    assert ids.engine_id(30) is None and len(ids) == 0
