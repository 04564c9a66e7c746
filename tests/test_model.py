"""Greedy outputs equal transformers' token for token (the obviously-correct reference)."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.conftest import TINY_CONFIGS, hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("max_num_tokens", [2048, 7])
def test_tiny_llama_matches_transformers(tiny_models, name, max_num_tokens):
    from transformers import AutoModelForCausalLM

    path = tiny_models[name]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # lengths span several blocks of 4 and (llama3 config) past the original 64 positions
    prompts = random_prompts(512, [1, 5, 17, 40, 90])
    expected = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    with LLM(str(path), block_size=4, max_num_tokens=max_num_tokens, num_kv_blocks=128) as llm:
        outs = llm.generate(prompts, GREEDY)
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)


def _smollm2_prompts(llm) -> list[list[int]]:
    tok = llm.tokenizer
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Explain in one sentence what a CPU does.", "What is 12 times 12?"]
    chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    story = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
             "as his father had taught him, and wrote the weather in a leather book. ") * 6
    long_prompt = tok.encode(story + "Summarize the story in one sentence:")
    assert len(long_prompt) > 8 * 16, "the long prompt must span several blocks"
    return chats + [long_prompt]


@pytest.mark.slow
@pytest.mark.parametrize("max_num_tokens", [2048, pytest.param(24, marks=pytest.mark.extended)])
def test_smollm2_gguf_matches_transformers(smollm2_path, smollm2_hf, max_num_tokens):
    with LLM(smollm2_path, max_num_tokens=max_num_tokens, num_kv_blocks=256,
             overlap_scheduler=max_num_tokens == 24) as llm:
        prompts = _smollm2_prompts(llm)
        sampling = SamplingParams(max_tokens=20)
        outs = llm.generate(prompts, sampling)
        llm.check_integrity()
        texts = [o.text for o in outs]
    expected = [hf_greedy(smollm2_hf, p, 20, eos_token_id=2) for p in prompts]
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in texts[0]


def _hf_generate(model, prompt_ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, temperature=None,
                             top_p=None, top_k=None, **kw)
    return out[0, len(prompt_ids):].tolist()


class _FrequencyPresence:
    """OpenAI's frequency and presence penalties as a transformers logits processor (over
    the generated tokens only): the reference for Shoal's."""

    def __init__(self, num_prompt: int, frequency: float, presence: float):
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.num_prompt:], torch.ones_like(
            input_ids[:, self.num_prompt:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


@pytest.mark.parametrize("overlap, max_num_tokens", [(False, 2048), (True, 7)])
def test_penalties_bias_and_min_tokens_match_transformers(tiny_model, overlap, max_num_tokens):
    """Greedy requests, each with one of the sampler's logit settings, batched together,
    equal transformers' generate with its own processors for the same setting; a request
    with none is unchanged."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    n = 24
    prompts = random_prompts(512, [9, 13, 6, 21, 11], seed=4)
    plain = [hf_greedy(ref, p, n) for p in prompts]
    stop = plain[3][2]  # min_tokens: a token the plain answer draws early
    boosted, banned = (plain[2][1] + 1) % 512, plain[2][0]
    settings = [
        (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
        (dict(frequency_penalty=1.0, presence_penalty=0.5),
         dict(logits_processor=LogitsProcessorList([_FrequencyPresence(13, 1.0, 0.5)]))),
        (dict(logit_bias={boosted: 3.0, banned: -100.0}),
         dict(sequence_bias={(boosted,): 3.0, (banned,): -100.0})),
        (dict(min_tokens=8, stop_token_ids=(stop,)), dict(min_new_tokens=8, eos_token_id=stop)),
        (dict(), dict())]
    expected = [_hf_generate(ref, p, n, **hf) for p, (_, hf) in zip(prompts, settings)]
    sampling = [SamplingParams(max_tokens=n, **ours) for ours, _ in settings]
    with LLM(tiny_model, block_size=4, max_num_tokens=max_num_tokens, num_kv_blocks=128,
             overlap_scheduler=overlap) as llm:
        outs = llm.generate(prompts, sampling)
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected
    assert all(e != p for e, p in zip(expected[:4], plain[:4]))  # each setting changed it
    assert expected[4] == plain[4] and stop not in expected[3][:8]


@pytest.mark.parametrize("max_num_tokens", [2048, 7])
def test_prompt_logprobs_match_transformers(tiny_model, max_num_tokens):
    """Each prompt token's logprob (and rank, and the top k) under transformers' forward of
    the prompt; computed whole even when the prefix cache holds the prompt, and in chunks."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = random_prompts(512, [37], seed=6)[0]
    with torch.inference_mode():
        logp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), -1)
    with LLM(tiny_model, block_size=4, max_num_tokens=max_num_tokens, num_kv_blocks=64) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=2))  # the prompt is in the cache now
        out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
        plain = llm.generate([prompt], SamplingParams(max_tokens=2))[0]
        llm.check_integrity()
    assert out.num_local_prefix_tokens == 0 and plain.num_local_prefix_tokens > 0
    assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        row = logp[p - 1]
        assert abs(lps[p].logprob - row[prompt[p]].item()) < 1e-4
        assert lps[p].rank == int((row > row[prompt[p]]).sum()) + 1
        assert [t for t, _ in lps[p].top] == row.topk(3).indices.tolist()


def test_attention_weight_is_a_pair_of_attention_against_a_token_through_the_weights():
    """The load split's cost model (LlamaModel.attention_weight), by hand: FLOPs of one
    (query, key) pair (QK and PV, every head and layer) over a token's matmul FLOPs, of the
    experts only the top k's."""
    from shoal.model.config import ModelConfig
    from shoal.model.llama import LlamaModel
    common = dict(vocab_size=16, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                  tie_word_embeddings=False)
    with torch.device("meta"):
        dense = LlamaModel(ModelConfig(intermediate_size=32, **common))
        moe = LlamaModel(ModelConfig(intermediate_size=32, family="qwen3_moe", num_experts=8,
                                     num_experts_per_tok=2, moe_intermediate_size=40,
                                     moe_layers=(1,), **common))
    attn = 48 * (4 + 2 + 2) * 8 + 4 * 8 * 48  # qkv, o
    pair = (8 + 8) * 4 * 2  # d_qk + d_v, heads, layers
    assert dense.attention_weight() == pytest.approx(pair / (2 * (attn + 3 * 48 * 32)))
    experts = 2 * 3 * 48 * 40 + 48 * 8  # two experts' gate, up, down; the router
    assert moe.attention_weight() == pytest.approx(
        pair / (2 * attn + 3 * 48 * 32 + experts))
    # over 2 ranks: TP halves heads, columns and experts (the router is whole on each
    # rank); under ADP a rank's half of the MLP and of the experts, and its whole router,
    # run both owners' tokens
    from shoal.model.shard import Shard
    tp, adp = Shard(rank=1, size=2), Shard(rank=1, size=2, gather=lambda t: t)
    with torch.device("meta"):
        split = {(s, name): LlamaModel(model.cfg, s) for s in (tp, adp)
                 for name, model in (("dense", dense), ("moe", moe))}
    for s in (tp, adp):
        assert split[s, "dense"].attention_weight() == pytest.approx(dense.attention_weight())
    router, routed = 48 * 8, 2 * 3 * 48 * 40
    assert split[tp, "moe"].attention_weight() == pytest.approx(
        pair / 2 / ((2 * attn + 3 * 48 * 32 + routed) / 2 + router))
    assert split[adp, "moe"].attention_weight() == pytest.approx(
        pair / (2 * attn + 3 * 48 * 32 + 2 * router + routed))
