"""Token sampling for a mixed batch of requests."""

from inflight.sampling.sampler import Sampler, SamplerOutput, SamplingRow

__all__ = ["Sampler", "SamplerOutput", "SamplingRow"]
