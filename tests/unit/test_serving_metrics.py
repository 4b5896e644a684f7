"""The engine model's Triton metric families: nothing of them may outlive `close()`.

A `pb_utils.MetricFamily` freed after its stub's shared memory is gone (when the stub tears down
the model object at exit) writes to that memory and segfaults; `close()` runs in `finalize()`,
while the memory exists, so it must drop the last reference to every metric and family.
"""

from __future__ import annotations

import gc
import weakref

from inflight.api.stats import IterationStats
from inflight.serving.metrics import TritonMetrics


class _FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels = labels

    def set(self, value):
        pass

    def observe(self, value):
        pass


class _FakeFamily:
    GAUGE, HISTOGRAM = "gauge", "histogram"
    made: list = []  # weak references to every family and metric made

    def __init__(self, name, description, kind):
        self.name = name
        _FakeFamily.made.append(weakref.ref(self))

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        metric = _FakeMetric(labels, buckets)
        _FakeFamily.made.append(weakref.ref(metric))
        return metric


class _FakePbUtils:
    MetricFamily = _FakeFamily


def test_close_releases_every_family_and_metric():
    _FakeFamily.made = []
    metrics = TritonMetrics(_FakePbUtils, "tensorrt_llm", 1, log_warn=print)
    metrics.publish(IterationStats())
    assert len(_FakeFamily.made) > 2  # families, histograms and the gauges published
    metrics.close()
    gc.collect()
    alive = [ref() for ref in _FakeFamily.made if ref() is not None]
    assert not alive, f"still referenced after close(): {alive}"



def test_token_lengths_are_observed_by_the_housekeeper_not_the_caller(monkeypatch):
    """Each observation is a round trip to the server: `observe` (the responder, per finished
    request) only keeps the lengths, `flush_finished` (the housekeeper) observes them."""
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(_FakeMetric, "observe",
                        lambda self, value: seen.append((self.labels["response_metric_type"], value)))
    metrics = TritonMetrics(_FakePbUtils, "tensorrt_llm", 1, log_warn=print)
    metrics.observe(SimpleNamespace(num_input_tokens=5, num_output_tokens=7))
    assert seen == []
    metrics.flush_finished()
    assert sorted(seen) == [("total_input_tokens", 5), ("total_output_tokens", 7)]
    assert not metrics.finished
