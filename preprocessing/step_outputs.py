"""Which outputs preprocessing leaves out when it answers a step of the pipeline.

NVIDIA's preprocessing answers every output it declares, most of them defaults: no bad or stop
words (`[1, 2, 0]`), no embedding bias (`[1, 0]`), and the decoder inputs of encoder-decoder
models (`[pad_id]`, `[1]`). Each output costs the python backend a round through shared memory
and the ensemble a tensor to route, on every request's way to its first token: 7-10 µs each on
the 2-core CPU (bench/preprocessing_cost.py), a small part of preprocessing's time.

Triton 2.51's ensemble scheduler (core r24.10, `EnsembleContext::ConsumeResponse`) records a
mapped output that a step's response leaves out as "not provided", and the next step then runs
without that input, as it does for an optional ensemble input the client did not send: the
input must be optional there, and every `tensorrt_llm` input is. Checked on a real server
(tests/e2e/test_ensemble.py): streamed and not, over gRPC and HTTP, and through the BLS model.
`tensorrt_llm` reads an absent word list or bias as none (`inflight.serving.convert`), exactly
as the empty ones, and ignores the decoder inputs of this decoder-only model.

Only a request that names exactly the outputs the pipeline maps into `tensorrt_llm` gets the
short answer: the ensemble's step and the BLS model ask for those (`PREPROCESSING_TO_ENGINE`).
A client calling preprocessing itself asks for every output (Triton lists them all when the
client names none), or for the ones it names, and gets the full answer, as from NVIDIA's model
(its end_to_end_test.py reads DECODER_INPUT_ID).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ensemble.wiring import PREPROCESSING_TO_ENGINE

# What the ensemble's preprocessing step and the BLS model request.
PIPELINE_OUTPUTS = frozenset(PREPROCESSING_TO_ENGINE)
# Read by tensorrt_llm only for an encoder-decoder model, which this repository does not serve.
DECODER_OUTPUTS = ("DECODER_INPUT_ID", "REQUEST_DECODER_INPUT_LEN")
# An empty one and an absent one mean the same to tensorrt_llm: no words, no bias.
EMPTY_MEANS_NONE = ("BAD_WORDS_IDS", "STOP_WORDS_IDS", "EMBEDDING_BIAS")


def is_pipeline_request(requested_output_names: Iterable[str]) -> bool:
    """True for the ensemble's step and the BLS model's request (see the module docstring)."""
    return frozenset(requested_output_names) == PIPELINE_OUTPUTS


def pipeline_outputs(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`outputs` less those that carry nothing for tensorrt_llm (a new dict)."""
    return {name: value for name, value in outputs.items()
            if name not in DECODER_OUTPUTS and not (name in EMPTY_MEANS_NONE and value.size == 0)}
