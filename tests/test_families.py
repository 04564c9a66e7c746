"""The served families (Llama 3.x, Mistral, Qwen2, Qwen3) from HF directories and GGUF files:
greedy outputs equal transformers', and every engine feature works for each family."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
from shoal.model.config import ModelConfig
from shoal.model.rope_scaling import RopeScaling
from shoal.model.llama import LlamaModel
from shoal.model.loader import load_model_config, load_model_source
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
KW = dict(block_size=4, num_kv_blocks=96)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    # name -> (transformers config class, overrides, GGUF architecture); every one is GQA
    "llama3": ("LlamaConfig", dict(tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE), "llama"),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, head_dim=16), "llama"),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), "qwen2"),
    # head_dim 32 while hidden_size / heads = 16: the explicit head_dim must win
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32), "qwen3"),
}


def make_family(path, name, seed=0, **extra):
    """A random checkpoint of the family under `path`, its norms and biases made visible
    (transformers initialises norms to 1 and biases to 0, which would hide a missing one)."""
    import transformers

    config_cls, overrides, _ = FAMILIES[name]
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0, initializer_range=0.15)
    cfg = getattr(transformers, config_cls)(**{**fields, **overrides, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif param_name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path, max_shard_size="100KB" if name == "qwen3" else "1GB")
    if name == "qwen3":  # in shards, next to a file the index does not name (as Mistral's)
        from safetensors.torch import save_file
        save_file({"stray": torch.zeros(1)}, str(path / "consolidated.safetensors"))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: make_family(root / name, name) for name in FAMILIES}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, [1, 6, 17, 41])


@pytest.fixture(scope="module")
def expected(models, prompts):
    """transformers' greedy tokens per family, computed once."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in models.items():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    return out


def run(model, prompts, **kw):
    with LLM(str(model), **{**KW, **kw}) as llm:
        outs = llm.generate(prompts, GREEDY)
        llm.check_integrity()
    return outs


def test_checkpoints_have_what_the_family_adds(models):
    """The fixtures are not degenerate: a missing bias or norm would change the outputs."""
    qwen2 = load_model_source(str(models["qwen2"])).weights
    assert min(w.abs().max() for k, w in qwen2.items() if k.endswith("_proj.bias")) > 0.3
    qwen3 = load_model_source(str(models["qwen3"]))
    assert qwen3.config.head_dim == 32 and qwen3.config.qk_norm
    assert (models["qwen3"] / "model.safetensors.index.json").is_file()
    assert min((w - 1).abs().max() for k, w in qwen3.weights.items() if "_norm" in k) > 0.3


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["plain", "overlap", "chunked"])
def test_greedy_matches_transformers(models, prompts, expected, name, mode):
    kw = {"plain": dict(overlap_scheduler=False), "overlap": dict(overlap_scheduler=True),
          "chunked": dict(overlap_scheduler=True, max_num_tokens=7)}[mode]
    outs = run(models[name], prompts, **kw)
    assert [o.token_ids for o in outs] == expected[name]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_pool_round_trip(models, prompts, expected, name, tmp_path):
    # whole loads: with compute-while-loading on, the front of a tiny model may compute a
    # hit before its first block lands (test_compute_while_loading covers that split)
    pool = ConnectorConfig(name="fs", options={"root": str(tmp_path)},
                           compute_while_loading=False)
    runs = [run(models[name], prompts, kv_connector=pool) for _ in ("save", "load")]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]] == expected[name]
    assert all(o.num_connector_tokens == 0 for o in runs[0])
    assert all(o.num_connector_tokens > 0 for o, p in zip(runs[1], prompts) if len(p) > 4)


def test_yarn_rope_matches_transformers(tmp_path, prompts):
    """YaRN (Qwen2.5's long-context recipe, DeepSeek's): blended frequencies and a cos/sin
    factor, as transformers applies them."""
    from transformers import AutoModelForCausalLM
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    path = make_family(tmp_path / "qwen2-yarn", "qwen2", rope_scaling=yarn)
    assert load_model_config(str(path)).rope_scaling.factor == 4.0
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert [o.token_ids for o in run(path, prompts)] == [hf_greedy(ref, p, 16) for p in prompts]


@pytest.mark.parametrize("mode", ["tp_size", "dp_size"])
def test_two_ranks_equal_one(models, prompts, expected, mode):
    # the families whose sharding differs from Llama's: q/k/v bias and q/k norms
    for name in ("qwen2", "qwen3"):
        outs = run(models[name], prompts, **{mode: 2}, max_num_tokens=24)
        assert [o.token_ids for o in outs] == expected[name], name


def test_model_identity_differs_between_families(models):
    configs = {name: load_model_config(str(path)) for name, path in models.items()}
    assert len({c.to_json() for c in configs.values()}) == len(FAMILIES)
    qwen2 = json.loads(configs["qwen2"].to_json())
    assert (qwen2["family"], qwen2["qkv_bias"], qwen2["qk_norm"]) == ("qwen2", True, False)
    # the same shapes under another family name are another model
    as_llama = dataclasses.replace(configs["qwen2"], family="llama", qkv_bias=False)
    assert as_llama.to_json() != configs["qwen2"].to_json()


# --- GGUF: written here from the HF checkpoint the way llama.cpp's converter writes it ---

GGUF_NAMES = {  # HF layer name -> llama.cpp's
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Llama converter: interleave the two RoPE halves of each head's rows."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama_cpp_rope_freqs(cfg: dict) -> np.ndarray:
    """llama.cpp's converter: llama3 rope_scaling baked into per-frequency divisors."""
    rope = cfg.get("rope_parameters") or cfg["rope_scaling"]
    dim = cfg["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    orig = rope["original_max_position_embeddings"]
    low, high = orig / rope["low_freq_factor"], orig / rope["high_freq_factor"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(rope["factor"])
        else:
            s = (orig / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            out.append(1 / ((1 - s) / rope["factor"] + s))
    return np.array(out, dtype=np.float32)


def write_gguf(hf_dir, path, name):
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = FAMILIES[name][2]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    index = hf_dir / "model.safetensors.index.json"
    files = (set(json.loads(index.read_text())["weight_map"].values()) if index.is_file()
             else {"model.safetensors"})
    weights = {}
    for f in sorted(files):
        weights.update(load_file(str(hf_dir / f)))
    if cfg["rope_parameters"].get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(cfg))
    for hf_name, t in sorted(weights.items()):
        a = t.float().numpy()
        if hf_name == "lm_head.weight":
            if not cfg["tie_word_embeddings"]:
                w.add_tensor("output.weight", a)
            continue
        fixed = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight"}
        if hf_name in fixed:
            w.add_tensor(fixed[hf_name], a)
            continue
        _, _, layer, *part, kind = hf_name.split(".")
        gguf_part = GGUF_NAMES[".".join(part)]
        if arch == "llama" and gguf_part in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads" if gguf_part == "attn_q" else "num_key_value_heads"]
            a = llama_cpp_permute(a, heads)
        w.add_tensor(f"blk.{layer}.{gguf_part}.{kind}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gguf_loads_the_same_model(models, prompts, expected, name, tmp_path):
    hf = load_model_source(str(models[name]))
    gguf_path = write_gguf(models[name], tmp_path / f"{name}.gguf", name)
    src = load_model_source(str(gguf_path))
    # GGUF stores eps as float32; Mistral files say "llama" (llama.cpp converts them so)
    same = dataclasses.replace(src.config, family=hf.config.family, rms_norm_eps=1e-5)
    assert same == hf.config
    assert src.config.rms_norm_eps == pytest.approx(1e-5)
    a, b = LlamaModel(hf.config), LlamaModel(src.config)
    a.load_hf_state_dict(hf.weights)
    b.load_hf_state_dict(src.weights)
    for (ka, va), (kb, vb) in zip([*a.named_parameters(), *a.named_buffers()],
                                  [*b.named_parameters(), *b.named_buffers()]):
        assert ka == kb and torch.equal(va, vb), ka
    outs = run(gguf_path, prompts)
    assert [o.token_ids for o in outs] == expected[name]


def test_llama3_rope_freqs_map_back_to_the_hf_parameters():
    """Llama 3.1 (factor 8) and 3.2 (factor 32) as llama.cpp stores them."""
    for factor in (8.0, 32.0):
        cfg = {"head_dim": 128, "rope_parameters": {
            "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
        got = RopeScaling.from_freq_factors(llama_cpp_rope_freqs(cfg).tolist(), 500000.0, 128)
        assert got == RopeScaling(factor, 1.0, 4.0, 8192)
    assert RopeScaling.from_freq_factors([1.0] * 64, 500000.0, 128) is None
    with pytest.raises(ValueError, match="not a llama3 RoPE scaling"):
        RopeScaling.from_freq_factors([1.0 + i / 10 for i in range(64)], 500000.0, 128)


def hf_dict(**fields):
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=32768)
    return {**base, **fields}


def test_refusals_name_what_is_unsupported(tmp_path):
    supported = r"'GPTNeoXForCausalLM'.*LlamaForCausalLM.*Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=supported):
        ModelConfig.from_hf(hf_dict(architectures=["GPTNeoXForCausalLM"]))
    (tmp_path / "config.json").write_text(json.dumps(hf_dict(architectures=["Gemma2ForCausalLM"])))
    with pytest.raises(ValueError, match="'Gemma2ForCausalLM'"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf(hf_dict(architectures=["LlamaForCausalLM"], attention_bias=True))
    with pytest.raises(ValueError, match="'longrope'"):
        ModelConfig.from_hf(hf_dict(architectures=["Qwen2ForCausalLM"],
                                    rope_scaling={"rope_type": "longrope", "factor": 4.0}))
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        load_model_config(str(tmp_path / "gpt2.gguf"))


def test_sliding_window_caps_the_context():
    """Within its window, sliding attention is full attention: the context stops there."""
    mistral = ModelConfig.from_hf(hf_dict(architectures=["MistralForCausalLM"],
                                          sliding_window=4096))
    assert (mistral.family, mistral.max_position_embeddings) == ("mistral", 4096)
    v03 = ModelConfig.from_hf(hf_dict(architectures=["MistralForCausalLM"], sliding_window=None))
    assert v03.max_position_embeddings == 32768
    # Qwen2.5 configs name a window they do not use
    qwen = ModelConfig.from_hf(hf_dict(architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                                       use_sliding_window=False))
    assert qwen.max_position_embeddings == 32768 and qwen.qkv_bias


def test_mistral_window_end_to_end(tmp_path, prompts):
    from transformers import AutoModelForCausalLM

    path = make_family(tmp_path, "mistral", sliding_window=16)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = prompts[1]  # 6 tokens: 10 more fill the 16-token window
    out = run(path, [prompt])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    assert out.token_ids == hf_greedy(ref, prompt, 10)
