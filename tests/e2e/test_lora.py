"""LoRA end to end: a real tritonserver whose repository was built with two PEFT adapters
(`--lora_modules`, made here with `peft` on the default model), driven as NVIDIA's clients
drive TensorRT-LLM's (`lora_task_id`, and `lora_weights` / `lora_config` with an adapter's first
request) through `tensorrt_llm`, the ensemble and the BLS model, and by name through the OpenAI
frontend. The default model runs in fp32 on the CPU, so the adapters' greedy answers are PEFT's."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.lora.nvidia import to_nvidia
from inflight.lora.peft import read_peft
from inflight.model.config import ModelConfig
from tests.e2e.conftest import Frontend
from tests.e2e.test_nvidia_compat import stream_once, text_inputs, text_of, token_inputs
from tools.local_server import running_server

pytestmark = pytest.mark.e2e

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"
NOT_CACHED = "LoRA task 7 not found in cache. Please send LoRA weights with request"


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory):
    """Two PEFT adapters on SmolLM2 (random A and B, big enough to change the answer): "sql" of
    rank 8 on every projection, "chat" of rank 4 rsLoRA on q/v; name -> (folder, PEFT model)."""
    # Imported here, not at collection: peft imports triton, which must not load before the
    # kernel tier has chosen Triton's CPU interpreter (tests/kernels/conftest.py).
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    made = {}
    for name, seed, fields in [("sql", 1, {"r": 8, "lora_alpha": 32, "target_modules": "all-linear"}),
                               ("chat", 2, {"r": 4, "lora_alpha": 16, "use_rslora": True,
                                            "target_modules": ["q_proj", "v_proj"]})]:
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
        model = get_peft_model(base, PeftLoraConfig(init_lora_weights=False, **fields)).eval()
        folder = tmp_path_factory.mktemp(f"peft_{name}")
        model.save_pretrained(folder)
        made[name] = (folder, model)
    return made


@pytest.fixture(scope="module")
def lora_server(smollm2_dir, adapters, tmp_path_factory, server_stops):
    modules = " ".join(f"{name}={folder}" for name, (folder, _) in adapters.items())
    with running_server(smollm2_dir, tmp_path_factory.mktemp("lora_server"), lora_modules=modules,
                        stops=server_stops) as handle:
        yield handle


def _infer_tokens(server, **extra) -> list[int]:
    """tensorrt_llm's greedy output ids (inflight_batcher_llm_client.py's request); raises
    RuntimeError with the server's error."""
    values = token_inputs(PROMPT_IDS, exclude_input_in_output=np.array([[True]]), **extra)
    results, errors, _ = stream_once(server, values, "tensorrt_llm")
    if errors:
        raise RuntimeError(errors[0])
    [result] = results
    return result.as_numpy("output_ids")[0][0][:int(result.as_numpy("sequence_length")[0][0])].tolist()


def _peft_greedy(model, num_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([PROMPT_IDS]), max_new_tokens=num_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT_IDS):].tolist()


def test_prefetched_adapters_answer_by_task_id_as_peft_does(lora_server, adapters):
    base = _infer_tokens(lora_server)
    for task_id, name in enumerate(adapters, start=1):  # --lora_modules numbers them in order
        tokens = _infer_tokens(lora_server, lora_task_id=np.array([[task_id]], np.uint64))
        assert tokens != base
        # fp32 on both sides, a short greedy run: equal unless a near tie (not seen with these seeds).
        assert tokens == _peft_greedy(adapters[name][1], len(tokens))


def test_weights_sent_with_the_first_request_then_the_id_alone(lora_server, adapters, smollm2_dir):
    client_rows = to_nvidia(read_peft(adapters["chat"][0], ModelConfig.from_dir(smollm2_dir)))  # fp16
    weights, rows = (np.asarray(a)[np.newaxis] for a in client_rows)  # [1, N, W] as the client sends
    with pytest.raises(Exception, match=NOT_CACHED):
        _infer_tokens(lora_server, lora_task_id=np.array([[7]], np.uint64))
    first = _infer_tokens(lora_server, lora_task_id=np.array([[7]], np.uint64), lora_weights=weights,
                          lora_config=rows)
    assert _infer_tokens(lora_server, lora_task_id=np.array([[7]], np.uint64)) == first


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_the_ensemble_and_the_bls_model_forward_the_task_id(lora_server, model):
    values = dict(text_inputs(max_tokens=8, exclude_input_in_output=np.array([[True]])),
                  temperature=np.array([[0.0]], np.float32))
    base, errors, _ = stream_once(lora_server, values, model)
    assert not errors, errors
    adapted, errors, _ = stream_once(lora_server, dict(values, lora_task_id=np.array([[1]], np.uint64)), model)
    assert not errors, errors
    assert text_of(adapted) != text_of(base)
    _, errors, _ = stream_once(lora_server, dict(values, lora_task_id=np.array([[9]], np.uint64)), model)
    assert errors and NOT_CACHED.replace("7", "9") in errors[0]


def test_the_openai_frontend_serves_each_adapter_by_name(lora_server, adapters, tokenizer):
    frontend = Frontend(lora_server.grpc_url).wait("/health/ready")
    try:
        models = httpx.get(frontend.url + "/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("ensemble", None), ("sql", "ensemble"),
                                                            ("chat", "ensemble")]
        texts = {}
        for name in ("ensemble", "sql", "chat"):
            reply = httpx.post(frontend.url + "/v1/completions", timeout=60, json={
                "model": name, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0})
            assert reply.status_code == 200, reply.text
            texts[name] = reply.json()["choices"][0]["text"]
        assert len(set(texts.values())) == 3
        assert texts["sql"] == tokenizer.decode(_peft_greedy(adapters["sql"][1], 6), skip_special_tokens=True)
        missing = httpx.post(frontend.url + "/v1/chat/completions", json={
            "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    finally:
        frontend.stop()

