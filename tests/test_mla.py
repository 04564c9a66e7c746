"""Multi-head latent attention (DeepSeek-V2/V3): absorbed decode against expanded attention,
YaRN against transformers, the latent cache layout, latent blocks through the pool (a fresh
ADP fleet loads them; a corrupt one is a miss, recomputed and set aside), hub configs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
from shoal.connectors.fs import format as pf
from shoal.kv.block_keys import extend_block_keys, request_seed
from shoal.model.attention_backend import TorchBackend
from shoal.model.config import ModelConfig
from shoal.model.llama import LlamaModel
from shoal.model.mla import MLAttention
from shoal.model.rope import rope_attention_factor, rope_inv_freq, softmax_scale
from shoal.model.shard import Shard
from tests.conftest import hf_greedy, random_prompts

SP = SamplingParams(max_tokens=12, ignore_eos=True)
KW = dict(block_size=4, num_kv_blocks=128)


def hf_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def v3(tiny_moe_models):
    return tiny_moe_models["deepseek_v3"]


@pytest.fixture(scope="module")
def expected_v3(v3):
    from transformers import AutoModelForCausalLM
    shared = random_prompts(512, [24], seed=21)[0]
    prompts = [shared + tail for tail in random_prompts(512, [3, 9, 14], seed=22)]
    ref = AutoModelForCausalLM.from_pretrained(v3, dtype=torch.float32).eval()
    return prompts, [hf_greedy(ref, p, SP.max_tokens) for p in prompts]


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
@torch.no_grad()
def test_absorbed_decode_equals_expanded_attention(tiny_moe_models, name):
    """On identical inputs (float64, random latents in a paged cache, contexts of several
    lengths), the absorbed form equals attention over the expanded per-head K and V."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(hf_config(tiny_moe_models[name]))
    attn = MLAttention(cfg, 0, Shard(), TorchBackend()).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    heads, bs, num_blocks = attn.num_heads, 4, 16
    cache = torch.randn(num_blocks, bs, 1, cfg.kv_lora_rank + cfg.head_dim, dtype=torch.float64)
    ctxs = [1, 7, 13, 16]
    table = torch.stack([torch.randperm(num_blocks)[:4] for _ in ctxs])
    q_nope = torch.randn(len(ctxs), heads, cfg.qk_nope_head_dim, dtype=torch.float64)
    q_rot = torch.randn(len(ctxs), heads, cfg.head_dim, dtype=torch.float64)
    absorbed = attn.absorbed(q_nope, q_rot, cache, table, ctxs)
    for b, ctx in enumerate(ctxs):
        blocks = table[b, :math.ceil(ctx / bs)]
        expanded = attn.expanded(q_nope[b:b + 1], q_rot[b:b + 1], cache, blocks, ctx)
        torch.testing.assert_close(absorbed[b:b + 1], expanded, rtol=1e-10, atol=1e-12)
    # the last context's own latent matters: changing it changes the answer
    last = table[-1, 3]
    cache[last, 3] += 1.0
    assert not torch.allclose(attn.absorbed(q_nope, q_rot, cache, table, ctxs)[-1], absorbed[-1])


@torch.no_grad()
def test_a_short_prefill_chunk_attends_absorbed_and_equals_expanded(tiny_moe_models, monkeypatch):
    """A chunk of at most ABSORBED_MAX_QUERY tokens after its context (a pool hit's last
    block) attends absorbed, a decode row per token over its context up to itself; a longer
    one expands the latents. On identical inputs (float64) both equal the expanded form."""
    from shoal.model.llama import AttentionMetadata, PagedInputs
    from shoal.model.mla import ABSORBED_MAX_QUERY

    torch.manual_seed(2)
    cfg = ModelConfig.from_hf(hf_config(tiny_moe_models["deepseek_v2"]))
    attn = MLAttention(cfg, 0, Shard(), TorchBackend()).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    bs, width = 4, 12
    cache = torch.randn(64, bs, 1, cfg.kv_lora_rank + cfg.head_dim, dtype=torch.float64)
    # two requests in one step: 5 tokens after 38 cached, then 20 tokens after 9
    chunks = [(5, 43), (ABSORBED_MAX_QUERY + 4, 29)]  # (tokens this step, context after it)
    table = torch.stack([torch.randperm(64)[:width] for _ in chunks])
    lens, ctxs = [n for n, _ in chunks], [c for _, c in chunks]
    starts = [0, lens[0]]
    total = sum(lens)
    q_nope = torch.randn(total, attn.num_heads, cfg.qk_nope_head_dim, dtype=torch.float64)
    q_rot = torch.randn(total, attn.num_heads, cfg.head_dim, dtype=torch.float64)
    paged = PagedInputs(table, torch.tensor(starts), torch.tensor(lens), torch.tensor(ctxs),
                        max(lens), host=(starts, lens, ctxs))
    meta = AttentionMetadata(torch.zeros(total, dtype=torch.long),
                             torch.zeros(total, dtype=torch.long), paged)
    expanded_sizes = []
    expanded = attn.expanded

    def spy(q_nope, q_rot, cache, block_ids, ctx):
        expanded_sizes.append(q_nope.shape[0])
        return expanded(q_nope, q_rot, cache, block_ids, ctx)

    monkeypatch.setattr(attn, "expanded", spy)
    out = attn._attend(q_nope, q_rot, meta, cache)
    assert expanded_sizes == [lens[1]]  # the short chunk expanded nothing
    for start, n, ctx, row in zip(starts, lens, ctxs, table):
        rows = slice(start, start + n)
        want = expanded(q_nope[rows], q_rot[rows], cache, row[:math.ceil(ctx / bs)], ctx)
        torch.testing.assert_close(out[rows], want, rtol=1e-10, atol=1e-12)


@torch.no_grad()
def test_a_short_chunk_gives_the_kernel_a_table_aligned_as_at_bring_up(tiny_moe_models,
                                                                        monkeypatch):
    """Triton compiles a kernel for each 16-byte alignment of its pointers, and the bring-up
    compiles MLA's decode for fresh (aligned) tensors. A short chunk's table must not be a
    view of its row in the step's table, which starts 4 bytes a block of width further on
    (on an H100 the eager engine compiled a fifth variant in a request)."""
    from shoal.model.attention_backend import TritonBackend
    from shoal.model.llama import AttentionMetadata, PagedInputs

    cfg = ModelConfig.from_hf(hf_config(tiny_moe_models["deepseek_v2"]))
    attn = MLAttention(cfg, 0, Shard(), TritonBackend())
    bs, width = 4, 3  # row 1 starts 12 bytes after row 0
    cache = torch.zeros(16, bs, 1, cfg.kv_lora_rank + cfg.head_dim)
    chunks = [(1, 5), (2, 7)]  # two short chunks: (tokens this step, context after it)
    lens, ctxs = [n for n, _ in chunks], [c for _, c in chunks]
    starts, total = [0, lens[0]], sum(lens)
    table = torch.arange(len(chunks) * width, dtype=torch.int32).view(len(chunks), width)
    paged = PagedInputs(table, torch.tensor(starts), torch.tensor(lens), torch.tensor(ctxs),
                        max(lens), host=(starts, lens, ctxs))
    meta = AttentionMetadata(torch.zeros(total, dtype=torch.long),
                             torch.zeros(total, dtype=torch.long), paged)
    seen = []

    def kernel(q, cache, table, lens, latent, scale):
        seen.append([t.data_ptr() % 16 for t in (q, cache, table, lens)])
        assert table.tolist() == [table[0].tolist()] * q.shape[0]  # one block list per row
        return q.new_zeros(q.shape[0], q.shape[1], latent)

    monkeypatch.setattr("shoal.model.mla.mla_decode", kernel)
    q_nope = torch.randn(total, attn.num_heads, cfg.qk_nope_head_dim)
    q_rot = torch.randn(total, attn.num_heads, cfg.head_dim)
    attn._attend(q_nope, q_rot, meta, cache)
    assert seen == [[0, 0, 0, 0]] * len(chunks)


@torch.no_grad()
def test_absorbed_decode_in_bfloat16_is_as_close_as_expanded(tiny_moe_models):
    """In bfloat16 both forms round differently; against the float64 answer the absorbed
    one is as close as the expanded one (which is what transformers computes)."""
    torch.manual_seed(1)
    cfg = ModelConfig.from_hf(hf_config(tiny_moe_models["deepseek_v3"]))
    exact = MLAttention(cfg, 0, Shard(), TorchBackend()).double()
    for p in exact.parameters():
        torch.nn.init.normal_(p, std=0.15)
    half = MLAttention(cfg, 0, Shard(), TorchBackend()).bfloat16()
    half.load_state_dict({k: v.bfloat16() for k, v in exact.state_dict().items()})
    cache = torch.randn(16, 4, 1, cfg.kv_lora_rank + cfg.head_dim, dtype=torch.float64)
    ctxs = [5, 13, 16]
    table = torch.stack([torch.randperm(16)[:4] for _ in ctxs])
    q_nope = torch.randn(len(ctxs), exact.num_heads, cfg.qk_nope_head_dim, dtype=torch.float64)
    q_rot = torch.randn(len(ctxs), exact.num_heads, cfg.head_dim, dtype=torch.float64)
    truth = exact.absorbed(q_nope, q_rot, cache, table, ctxs)
    c, qn, qr = cache.bfloat16(), q_nope.bfloat16(), q_rot.bfloat16()
    absorbed = half.absorbed(qn, qr, c, table, ctxs).double()
    expanded = torch.cat([half.expanded(qn[b:b + 1], qr[b:b + 1], c, table[b, :math.ceil(n / 4)], n)
                          for b, n in enumerate(ctxs)]).double()
    err = [float((x - truth).norm() / truth.norm()) for x in (absorbed, expanded)]
    assert err[0] < 0.01 and err[0] < 1.5 * err[1], err


def test_yarn_tables_match_transformers(v3):
    """Frequencies, the cos/sin factor and the softmax scale of YaRN, as transformers."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
    hf = AutoConfig.from_pretrained(v3)
    cfg = ModelConfig.from_hf(hf_config(v3))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    torch.testing.assert_close(rope_inv_freq(cfg), inv_freq, rtol=0, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-12) and factor != 1.0
    qk = cfg.qk_nope_head_dim + cfg.head_dim
    scale = yarn_apply_mscale(hf.rope_parameters, qk ** -0.5)
    assert softmax_scale(cfg, qk) == pytest.approx(scale, rel=1e-12) and scale != qk ** -0.5


def test_the_cache_keeps_one_latent_per_token(v3):
    """A block holds L + R numbers per token per layer (not 2 x heads x head_dim), and a TP
    rank keeps the whole latent: under ADP each rank holds its own requests only."""
    cfg = ModelConfig.from_hf(hf_config(v3))
    assert cfg.kv_token_shape(1) == cfg.kv_token_shape(2) == (1, 1, 32 + 8)
    dense = ModelConfig.from_hf({**hf_config(v3), "architectures": ["Qwen3MoeForCausalLM"],
                                 "num_key_value_heads": 2, "head_dim": 16})
    assert dense.kv_token_shape(2) == (2, 1, 16)  # a GQA rank holds half the KV heads
    with LLM(str(v3), **KW) as llm:
        assert llm.engine.info.block_nbytes == cfg.num_layers * 4 * (32 + 8) * 4


def test_a_fresh_adp_fleet_loads_latent_blocks_from_the_pool(v3, expected_v3, tmp_path):
    """dp 2, the pool on disk: the second fleet loads the prompts' latent blocks and answers
    as transformers does; one request alone leaves an owner idle, whose padding joins every
    layer's collectives and calls no connector."""
    prompts, want = expected_v3
    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path)}, compute_while_loading=False)
    for run in ("save", "load"):
        with LLM(str(v3), dp_size=2, kv_connector=cfg, **KW) as llm:
            outs = llm.generate(prompts, SP)
            llm.check_integrity()
            stats = llm.stats()
        assert [o.token_ids for o in outs] == want, run
        loaded = [s["connector_tokens_loaded"] for s in stats["per_rank"]]
        if run == "load":  # each owner loads the shared 24 tokens once (its later requests
            # hit them locally) and every request starts past them
            assert min(loaded) >= 24, loaded
            assert all(o.num_connector_tokens + o.num_local_prefix_tokens >= 24 for o in outs)
        else:
            assert loaded == [0, 0], loaded
    with LLM(str(v3), dp_size=2, kv_connector=cfg, **KW) as llm:
        alone = llm.generate(prompts[1:2], SP)[0]
        ranks = llm.stats()["per_rank"]
    assert alone.token_ids == want[1] and alone.num_connector_tokens >= 24
    idle = min(ranks, key=lambda s: s["prompt_tokens"])
    busy = max(ranks, key=lambda s: s["prompt_tokens"])
    assert idle["prompt_tokens"] == 0 and idle["forward_passes"] == busy["forward_passes"] > 0
    assert idle["data_collectives"] == busy["data_collectives"] > 0
    assert idle["pool_lookups"] == idle["connector_tokens_loaded"] == idle["blocks_saved"] == 0


def test_a_corrupt_latent_block_is_a_miss_recomputed_and_set_aside(v3, expected_v3, tmp_path):
    prompts, want = expected_v3
    with LLM(str(v3), kv_pool=str(tmp_path), **KW) as llm:
        assert [o.token_ids for o in llm.generate(prompts[:1], SP)] == want[:1]
        keys: list[bytes] = []
        extend_block_keys(keys, prompts[0], 4,
                          request_seed(bytes.fromhex(llm.engine.info.namespace), None))
    path = pf.block_path(tmp_path, keys[2])
    header = pf.parse_header(path.read_bytes()[:pf.HEADER_SIZE])
    assert header.shape == (3, 1, 4, 1, 40)  # layers, one part, tokens, one head, L + R
    data = path.read_bytes()
    path.write_bytes(data[:-9] + bytes([data[-9] ^ 0x10]) + data[-8:])
    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path)}, compute_while_loading=False)
    with LLM(str(v3), kv_connector=cfg, **KW) as llm:
        out = llm.generate(prompts[:1], SP)[0]
        llm.check_integrity()
        s = llm.stats()
    assert out.token_ids == want[0] and out.num_connector_tokens == 8  # blocks 0, 1
    assert s["corrupt_blocks"] == 1 and s["load_failures_recomputed"] == 1
    assert [q.name[:64] for q in (tmp_path / "quarantine").iterdir()] == [keys[2].hex()]


V2_LITE = dict(  # DeepSeek-V2-Lite's config.json (the fields that matter here)
    architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
    routed_scaling_factor=1.0, scoring_func="softmax", max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False, bos_token_id=100000,
    eos_token_id=100001, rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
                                       "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                                       "original_max_position_embeddings": 4096})


def test_hub_configs():
    lite = ModelConfig.from_hf(V2_LITE)
    assert lite.is_mla and lite.q_lora_rank == 0 and lite.head_dim == 64
    assert lite.moe_layers == tuple(range(1, 27)) and lite.num_shared_experts == 2
    assert lite.rope_scaling.factor == 40 and lite.rope_scaling.mscale_all_dim == 0.707
    assert lite.kv_token_shape() == (1, 1, 576)  # 27 layers x 576 x 2 bytes: 31 KB a token
    v3 = ModelConfig.from_hf({**V2_LITE, "architectures": ["DeepseekV3ForCausalLM"],
                              "n_routed_experts": 256, "n_group": 8, "topk_group": 4,
                              "num_experts_per_tok": 8, "norm_topk_prob": True, "q_lora_rank": 1536,
                              "routed_scaling_factor": 2.5, "first_k_dense_replace": 3})
    assert (v3.topk_method, v3.num_expert_groups, v3.topk_groups) == ("noaux_tc", 8, 4)
    assert v3.rope_interleave and v3.q_lora_rank == 1536 and v3.moe_layers[0] == 3
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_hf({**V2_LITE, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="norm_topk_prob"):
        ModelConfig.from_hf({**V2_LITE, "norm_topk_prob": True})
    with pytest.raises(ValueError, match="num_expert_groups"):
        ModelConfig.from_hf({**V2_LITE, "topk_method": "group_limited_greedy", "n_group": 5})
    with pytest.raises(ValueError, match="tp_size=3 must divide the model's num_heads"):
        LlamaModel(ModelConfig.from_hf({**V2_LITE, "num_hidden_layers": 1}), Shard(0, 3))


def test_v3_checkpoints_may_carry_the_prediction_layer(tiny_moe_models):
    """Hub V3 checkpoints hold a multi-token prediction layer after the last: not used.
    Another family's checkpoint with such a layer is refused, as any unused weight."""
    from safetensors.torch import load_file
    for name in ("deepseek_v3", "deepseek_v2"):
        path = tiny_moe_models[name]
        cfg = ModelConfig.from_hf(hf_config(path))
        weights = {**load_file(path / "model.safetensors"),
                   f"model.layers.{cfg.num_layers}.eh_proj.weight": torch.zeros(2, 2)}
        if name == "deepseek_v3":
            LlamaModel(cfg).load_hf_state_dict(weights)
        else:
            with pytest.raises(ValueError, match="does not use"):
                LlamaModel(cfg).load_hf_state_dict(weights)
