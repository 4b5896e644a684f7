"""tools/null_worker.py (what bench/host_cost.py times): its null worker runs real engine steps,
and a run with nothing to measure says why instead of failing on an empty median."""

from __future__ import annotations

import pytest

from tools import null_worker


@pytest.fixture(scope="module")
def host_cost():
    return null_worker


def test_null_worker_measures_decode_steps(host_cost):
    # The null worker skips Worker.__init__: an attribute the step needs and it lacks fails
    # every step (a failed step fails its requests; the engine carries on).
    engine = host_cost.make_engine(max_batch_size=4, max_seq_len=64)
    row = host_cost.measure(engine, batch=4, prompt_len=8, num_decode_steps=4)
    assert row["batch"] == 4 and row["steps"] > 0 and row["us_per_step"] > 0


def test_failed_steps_report_their_error(host_cost):
    engine = host_cost.make_engine(max_batch_size=2, max_seq_len=64)

    def fail(batch):
        raise RuntimeError("injected")

    engine.fault_hook = fail
    with pytest.raises(host_cost.NoDecodeSteps, match="2 of 2 requests failed.*injected"):
        host_cost.measure(engine, batch=2, prompt_len=8, num_decode_steps=4)
