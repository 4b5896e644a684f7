"""LoRA through the engine, on the CPU in fp32, against PEFT itself: adapters made with `peft`
on a tiny random Llama, sent as NVIDIA's `lora_weights` / `lora_config` (our converter's rows),
must give PEFT's logits; requests with different adapters and none share steps and get what
they get alone; the cache keeps TensorRT-LLM's contract (exact error texts, LRU eviction of
adapters no live request holds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.api.config import KvCacheConfig, PeftCacheConfig
from inflight.api.types import LoraConfig, OutputConfig, Request
from inflight.lora.nvidia import to_nvidia
from inflight.lora.peft import read_peft
from inflight.model.config import ModelConfig
from tests.model.engine_utils import final, gen_request, make_engine, output_tokens, run
from tests.model.numerics import logit_noise_bound

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[3, 17, 42, 9, 120, 7], [5, 5, 81, 64], [200, 1, 33, 90, 14, 2, 77, 18, 6]]
PEFT = PeftCacheConfig(max_loras=4, max_adapter_size=16)


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    """Two PEFT adapters (rank 4 on every projection; rank 8 rsLoRA on q, v and down), as
    PEFT models (the reference) and as NVIDIA rows (what requests send)."""
    # Imported here, not at collection: peft imports triton, which must not load before the
    # kernel tier has chosen Triton's CPU interpreter (tests/kernels/conftest.py).
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    made = {}
    for name, seed, fields in [("a", 1, {"r": 4, "lora_alpha": 8, "target_modules": ALL_MODULES}),
                               ("b", 2, {"r": 8, "lora_alpha": 4, "use_rslora": True,
                                             "target_modules": ["q_proj", "v_proj", "down_proj"]})]:
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        # Random A and B (PEFT's default B is zero, an adapter that changes nothing).
        model = get_peft_model(base, PeftLoraConfig(init_lora_weights=False, **fields)).eval()
        folder = tmp_path_factory.mktemp(f"lora_{name}")
        model.save_pretrained(folder)
        config = ModelConfig.from_dir(tiny_dir)
        weights, rows = to_nvidia(read_peft(folder, config), dtype=np.float32)  # fp16 would round them
        made[name] = (model, weights, rows)
    return made


def _request(prompt, lora=None, max_tokens=8, **output):
    request = gen_request(prompt, max_tokens)
    if output:
        request = Request(prompt, max_tokens, output_config=OutputConfig(exclude_input_from_output=True, **output))
    request.lora_config = lora
    return request


def _with_weights(adapters, name, task_id):
    _, weights, rows = adapters[name]
    return LoraConfig(task_id, weights, rows)


def test_prompt_logits_under_an_adapter_are_peft_models_logits(tiny_dir, adapters):
    engine = make_engine(tiny_dir, peft_cache_config=PEFT)
    config = engine.model_config
    for task_id, name in enumerate(("a", "b"), start=1):
        model = adapters[name][0]
        for prompt in PROMPTS:
            [responses] = run(engine, [_request(prompt, _with_weights(adapters, name, task_id), max_tokens=1,
                                                return_context_logits=True)])
            logits = torch.as_tensor(final(responses).result.context_logits).reshape(len(prompt), -1)
            with torch.no_grad():
                expected = model(torch.tensor([prompt])).logits[0]
            # Each adapted projection adds a second reduction (x·Aᵀ over the input width, then
            # over the rank) next to the base GEMM's: at most twice fp32's forward-pass noise.
            bound = 2 * logit_noise_bound(config, expected)
            diff = (logits.double() - expected.double()).abs().amax(dim=-1, keepdim=True)
            assert bool((diff <= bound).all()), (name, float((diff / bound).max()))
            # And the adapter matters: far outside that noise from the base model's logits.
            with torch.no_grad(), model.disable_adapter():
                base = model(torch.tensor([prompt])).logits[0]
            assert float((logits - base).abs().max()) > 100 * float(bound.max())


def test_a_batch_mixing_the_base_model_and_two_adapters_equals_separate_runs(tiny_dir, adapters):
    engine = make_engine(tiny_dir, peft_cache_config=PEFT)
    loras = [None, _with_weights(adapters, "a", 1), _with_weights(adapters, "b", 2), LoraConfig(1)]
    alone = []
    for prompt, lora in zip(PROMPTS + PROMPTS[:1], loras[:3] + [_with_weights(adapters, "a", 1)]):
        alone.append(output_tokens(run(engine, [_request(prompt, lora)])[0]))
    together = run(engine, [_request(p, lora) for p, lora in zip(PROMPTS + PROMPTS[:1], loras)])
    assert [output_tokens(r) for r in together] == alone
    assert alone[0] != alone[3]  # the same prompt, base vs adapter a: different answers


def test_an_unknown_task_id_gets_tensorrt_llms_error_and_later_requests_send_the_id_alone(tiny_dir, adapters):
    engine = make_engine(tiny_dir, peft_cache_config=PEFT)
    with pytest.raises(Exception, match="^LoRA task 7 not found in cache. Please send LoRA weights with request$"):
        engine.add_request(_request(PROMPTS[0], LoraConfig(7)))
    first = output_tokens(run(engine, [_request(PROMPTS[0], _with_weights(adapters, "a", 7))])[0])
    assert output_tokens(run(engine, [_request(PROMPTS[0], LoraConfig(7))])[0]) == first
    _, weights, _ = adapters["a"]
    with pytest.raises(Exception, match="lora_weights and lora_config come together"):
        engine.add_request(_request(PROMPTS[0], LoraConfig(8, weights, None)))


def test_the_least_recently_used_idle_adapter_is_evicted_and_a_held_one_never(tiny_dir, adapters):
    sizes = [_adapter_bytes(adapters, name) for name in ("a", "b")]
    assert max(sizes) + 1 < sum(sizes)  # room for either adapter, never both
    engine = make_engine(tiny_dir, peft_cache_config=PeftCacheConfig(max_loras=2, max_adapter_size=16,
                                                                     host_cache_size=max(sizes) + 1))
    run(engine, [_request(PROMPTS[0], _with_weights(adapters, "a", 1))])
    run(engine, [_request(PROMPTS[0], _with_weights(adapters, "b", 2))])  # only one fits: a goes
    with pytest.raises(Exception, match="LoRA task 1 not found in cache"):
        engine.add_request(_request(PROMPTS[0], LoraConfig(1)))
    # While a request holds b, a new adapter has nowhere to go: TensorRT-LLM's "cache full".
    engine.add_request(_request(PROMPTS[1], LoraConfig(2), max_tokens=4))
    engine.step()
    with pytest.raises(Exception, match="Cache is full. There are no done tasks to evict"):
        engine.add_request(_request(PROMPTS[0], _with_weights(adapters, "a", 3)))
    while engine.has_unfinished():
        engine.step()


def _adapter_bytes(adapters, name) -> int:
    """What the cache counts for an adapter: its A and B in fp32 (PEFT's own parameters)."""
    model = adapters[name][0]
    return sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)


def test_more_adapters_than_max_loras_take_turns_and_each_gets_its_own_answer(tiny_dir, adapters):
    engine = make_engine(tiny_dir, peft_cache_config=PeftCacheConfig(max_loras=1, max_adapter_size=16))
    loras = [_with_weights(adapters, "a", 1), _with_weights(adapters, "b", 2), None]
    alone = [output_tokens(run(engine, [_request(PROMPTS[i], lora)])[0]) for i, lora in enumerate(loras)]
    together = run(engine, [_request(PROMPTS[i], LoraConfig(i + 1) if i < 2 else None) for i in range(3)])
    assert [output_tokens(r) for r in together] == alone


def test_cached_prefix_blocks_are_kept_apart_per_adapter(tiny_dir, adapters):
    reuse = KvCacheConfig(max_tokens=4096, tokens_per_block=4, enable_block_reuse=True)
    prompt = PROMPTS[2] + PROMPTS[0]  # several full blocks
    fresh = make_engine(tiny_dir, peft_cache_config=PEFT, kv_cache_config=reuse)
    expected = output_tokens(run(fresh, [_request(prompt, _with_weights(adapters, "a", 1))])[0])
    engine = make_engine(tiny_dir, peft_cache_config=PEFT, kv_cache_config=reuse)
    run(engine, [_request(prompt)])  # the base model's blocks of the same tokens are cached
    assert output_tokens(run(engine, [_request(prompt, _with_weights(adapters, "a", 1))])[0]) == expected


def test_an_engine_without_lora_refuses_lora_requests_by_name(tiny_dir, adapters):
    engine = make_engine(tiny_dir)
    with pytest.raises(Exception, match="LoRA .*lora_task_id.* is off"):
        engine.add_request(_request(PROMPTS[0], _with_weights(adapters, "a", 1)))
