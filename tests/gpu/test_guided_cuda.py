"""Guided decoding on CUDA: the token mask reaches the logits without a host sync, and guided
output on the GPU engine is in its language (tiny random Llama, character vocabulary).

Run on the device machine through `bash checks/gpu_guided.sh` (it brings xgrammar's wheels).
"""

from __future__ import annotations

import pytest
import torch

from inflight.api.config import ExecutorConfig
from inflight.api.types import GuidedDecodingParams
from inflight.engine.llm_engine import LLMEngine
from inflight.sampling.grammar import GrammarCompiler
from inflight.sampling.row import SamplingRow
from inflight.sampling.sampler import Sampler
from tools.checkpoints import save_tiny_checkpoint
from tests.model.engine_utils import DEFAULT_KV, gen_request, output_tokens, run
from tests.model.guided_vocab import EOS, GUIDES, char_vocab, detokenize, guided_config
from tests.model.test_guided_decoding import assert_in_language

VOCAB = 500  # the tiny checkpoint's


def test_mask_is_built_and_applied_without_a_host_sync():
    """The step's only host wait stays the one for its sampled ids: building the mask (host),
    its copy (non-blocking, pinned) and applying it (device) never synchronize."""
    compiler = GrammarCompiler(guided_config(VOCAB), VOCAB)
    rows = [SamplingRow(token_ids=[1, 5], num_prompt_tokens=2, end_id=EOS,
                        guide=compiler.matcher(GuidedDecodingParams("regex", GUIDES["regex"]))),
            SamplingRow(token_ids=[1, 6], num_prompt_tokens=2, end_id=EOS)]
    logits = torch.randn(2, VOCAB, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        processed = Sampler.process_logits(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    allowed = {char_vocab(VOCAB)[t] for t in torch.isfinite(processed[0]).nonzero().flatten().cpu().tolist()}
    assert allowed == set("0123456789") | {"12"}  # the regex starts with a digit
    assert torch.isfinite(processed[1]).all()


@pytest.mark.parametrize("overlap", [False, True])
def test_guided_output_on_cuda_is_in_its_language(tmp_path, overlap):
    save_tiny_checkpoint("llama3", tmp_path)
    engine = LLMEngine.from_dir(tmp_path, ExecutorConfig(
        device="cuda", dtype="float32", kv_cache_config=DEFAULT_KV, enable_overlap_scheduler=overlap,
        guided_decoding_config=guided_config(VOCAB)))
    requests = [gen_request([1, 17, 250, 33], 100, end_id=EOS,
                            guided_decoding_params=GuidedDecodingParams(t, GUIDES[t])) for t in GUIDES]
    requests.append(gen_request([1, 5], 16))  # an unguided row in the same batches
    results = run(engine, requests)
    for guide_type, responses in zip(GUIDES, results):
        text = detokenize(output_tokens(responses), VOCAB)
        if guide_type in ("regex", "ebnf_grammar"):  # bounded languages: they must end
            assert_in_language(guide_type, text)
