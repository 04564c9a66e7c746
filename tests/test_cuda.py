"""The CUDA path: the same equality with transformers on a GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_llama_on_cuda_matches_transformers(tiny_models, overlap):
    from transformers import AutoModelForCausalLM

    path = tiny_models["gqa_tied"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to("cuda")
    prompts = random_prompts(512, [1, 5, 17, 40, 90])
    expected = [hf_greedy(ref, p, 24) for p in prompts]
    with LLM(str(path), device="cuda", block_size=4, num_kv_blocks=128, max_num_tokens=16,
             overlap_scheduler=overlap) as llm:
        assert llm.engine.kv_cache.tensor.is_cuda
        outs = llm.generate(prompts, SamplingParams(max_tokens=24))
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected


def test_smollm2_on_cuda_matches_transformers(smollm2_path, smollm2_hf):
    ref = smollm2_hf.to("cuda")
    try:
        with LLM(smollm2_path, device="cuda", num_kv_blocks=256) as llm:
            tok = llm.tokenizer
            prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
                       for q in ("What is the capital of France?", "Name three primary colors.")]
            prompts.append(tok.encode("The lighthouse keeper climbed the stairs. " * 20))
            outs = llm.generate(prompts, SamplingParams(max_tokens=20))
            llm.check_integrity()
        expected = [hf_greedy(ref, p, 20, eos_token_id=2) for p in prompts]
    finally:
        smollm2_hf.to("cpu")
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_fs_pool_round_trip_on_cuda(tiny_models, tmp_path, load_mode):
    """Saves copy GPU blocks to the host; loads read into pinned memory, then to the GPU."""
    from shoal.connectors import ConnectorConfig

    path = str(tiny_models["mha_untied"])
    prompts = random_prompts(512, [45, 30, 9])
    kw = dict(device="cuda", block_size=4, num_kv_blocks=128)
    with LLM(path, **kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12))]
    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path), "load_mode": load_mode})
    runs = []
    for _ in range(2):  # producer, then a fresh consumer
        with LLM(path, kv_connector=cfg, **kw) as llm:
            runs.append(llm.generate(prompts, SamplingParams(max_tokens=12)))
            llm.check_integrity()
    assert [o.token_ids for o in runs[0]] == expected
    assert [o.token_ids for o in runs[1]] == expected
    assert [o.num_connector_tokens for o in runs[1]] == [44, 28, 8]


def test_late_and_stalled_transfers_on_cuda(tiny_models, tmp_path):
    """The failure policy's paths on GPU blocks: late loads and saves (pinned staging) give
    the no-pool tokens; a load stalled past its deadline is aborted, that request errs."""
    from shoal.connectors import ConnectorConfig

    path = str(tiny_models["mha_untied"])
    prompts = random_prompts(512, [45, 30])
    kw = dict(device="cuda", block_size=4, num_kv_blocks=128)
    sp = SamplingParams(max_tokens=8)
    with LLM(path, **kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, sp)]

    def cfg(fault, timeout=600.0):
        return ConnectorConfig(module="tests.fault_connector", scheduler_class="FaultScheduler",
                               worker_class="FaultWorker",
                               options={"root": str(tmp_path), "fault": fault},
                               transfer_timeout_sec=timeout, control_grace_sec=0.5)
    for _ in ("producer", "consumer"):
        with LLM(path, kv_connector=cfg({"load_polls": 3, "save_polls": 3}), **kw) as llm:
            assert [o.token_ids for o in llm.generate(prompts, sp)] == expected
            llm.check_integrity()
    with LLM(path, kv_connector=cfg({"load_polls": -1}, timeout=1.0), **kw) as llm:
        outs = llm.generate(prompts, sp)
        llm.check_integrity()
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("aborted" in o.error for o in outs)
