"""Token sampling for a mixed batch of requests."""

from inflight.sampling.outputs import SamplerOutput
from inflight.sampling.row import SamplingRow
from inflight.sampling.sampler import Sampler

__all__ = ["Sampler", "SamplerOutput", "SamplingRow"]
