"""The Qwen3-MoE decoder (model/moe.py) against transformers' Qwen3MoeForCausalLM, its checkpoint
forms, its placement on the `expert` mesh axis, the sampler on it, and the router's
load-balancing loss against a float64 numpy reference.

Tiny random models (4 to 8 experts, width 32) written by transformers' `save_pretrained`; the
router weights are drawn large, so that routing differs from token to token and the top-k
renormalisation changes the logits by far more than the tolerance."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_models import np_load_balancing, tiny_moe
from test_model import TOL, max_diff, random_tokens, torch_logits

from ess_jax.config.presets import KNOWN_MODELS
from ess_jax.io import weights
from ess_jax.model import decoder as model
from ess_jax.model import moe, scoring
from ess_jax.parallel import sharding
from ess_jax.sampling import precision, sampler

# name: (layers, decoder_sparse_step, mlp_only_layers, norm_topk_prob, tied, experts, top-k)
CASES = {
    "sparse_norm": (2, 1, [], True, False, 8, 2),
    # step 2 and mlp_only_layers [3]: dense, sparse, dense, dense (3 is sparse by the step)
    "mixed_step": (4, 2, [3], False, True, 4, 2),
    "mixed_only": (3, 1, [1], True, False, 4, 3),
}


def _hf_model(layers, step, mlp_only, norm, tied, experts, top_k, seed=0):
    torch = pytest.importorskip("torch")
    import transformers

    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        decoder_sparse_step=step,
        mlp_only_layers=mlp_only,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    m = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # the router: peaked, token-dependent
                p.copy_(3.0 * torch.randn_like(p) / np.sqrt(p.shape[-1]))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return m


_apply = jax.jit(model.apply, static_argnums=0)
_tf_logp = jax.jit(scoring.token_logprobs, static_argnums=0)


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_hf_qwen3_moe_and_export_round_trip(case, tmp_path):
    """Catches: routing off transformers' (the top-k, the renormalisation under norm_topk_prob:
    planted, skipping it fails both norm_topk_prob cases by 0.4 and 1.4; float32 here, so not
    the casts a bfloat16 model makes), a sparse / dense layer choice off HF's
    decoder_sparse_step / mlp_only_layers rule, a transposed or misnamed expert tensor on load
    or export, and an exported config.json transformers reads as another model."""
    import transformers

    m = _hf_model(*CASES[case])
    m.save_pretrained(tmp_path / "hf")
    cfg, params = weights.load_hf(tmp_path / "hf")
    assert cfg.family == "qwen3_moe" and cfg.num_experts == CASES[case][5]
    hf_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in m.model.layers]
    assert [cfg.is_sparse(i) for i in range(cfg.num_layers)] == hf_sparse
    assert ["router" in params["layers"][i]["mlp"] for i in range(cfg.num_layers)] == hf_sparse

    tokens = random_tokens(cfg.vocab_size)
    ref = torch_logits(m, tokens)
    diff = max_diff(_apply(cfg, params, tokens), ref)
    print(f"{case}: max |logits - torch| = {diff:.2e}")
    assert diff <= TOL
    # left padding: the pads are routed too, and change nothing on the real tokens
    mask = jnp.ones(tokens.shape, bool).at[1, :3].set(False)
    ref_pad = torch_logits(m, tokens, mask)
    assert max_diff(_apply(cfg, params, tokens, mask)[1, 3:], ref_pad[1, 3:]) <= TOL

    # save_hf -> load_hf is exact; transformers loads our export and agrees
    weights.save_hf(cfg, params, tmp_path / "ours")
    cfg2, params2 = weights.load_hf(tmp_path / "ours")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(m2) is type(m)
    assert max_diff(torch_logits(m2, tokens), ref) <= TOL


def test_planted_bugs_break_parity(tmp_path):
    """The parity test's power: the top-k renormalisation skipped gives logits off
    transformers' by far more than TOL, and a layer's sparse / dense choice moved is refused
    on load (its expert tensors are not in the checkpoint)."""
    m = _hf_model(*CASES["sparse_norm"])
    m.save_pretrained(tmp_path / "hf")
    cfg, params = weights.load_hf(tmp_path / "hf")
    tokens = random_tokens(cfg.vocab_size)
    ref = torch_logits(m, tokens)
    assert max_diff(_apply(cfg, params, tokens), ref) <= TOL
    unnormed = max_diff(_apply(cfg.replace(norm_topk_prob=False), params, tokens), ref)
    assert unnormed > 100 * TOL, unnormed

    m = _hf_model(*CASES["mixed_step"])
    m.save_pretrained(tmp_path / "mixed")
    config = json.loads((tmp_path / "mixed" / "config.json").read_text())
    config["mlp_only_layers"] = []  # layer 3 sparse: its expert tensors are not there
    (tmp_path / "mixed" / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError, match=r"model\.layers\.3\.mlp\.experts\.0\."):
        weights.load_hf(tmp_path / "mixed")


def test_fused_expert_tensors_load_as_the_per_expert_ones(tmp_path):
    """transformers holds the experts fused (gate_up_proj [E, 2F, D], down_proj [E, D, F]);
    a checkpoint in that form loads to the same params. Catches: the gate and up halves
    swapped, a fused tensor read untransposed."""
    from safetensors.torch import save_file

    m = _hf_model(*CASES["mixed_only"])
    m.save_pretrained(tmp_path / "hf")
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd  # the in-memory form
    (tmp_path / "fused").mkdir()
    save_file(sd, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    cfg, want = weights.load_hf(tmp_path / "hf")
    cfg2, got = weights.load_hf(tmp_path / "fused")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_experts_sharded_on_the_expert_axis_equal_unsharded():
    """8 fake devices, mesh data 1 x fsdp 2 x tensor 2 x expert 2: the expert stacks split over
    `expert` (train layout: their D over fsdp too; sample layout: no fsdp), logits equal the
    one-device ones. Catches: rules that leave the experts replicated or put the expert axis on
    the wrong dim, and a combine over experts that is wrong once they are split."""
    cfg, params = tiny_moe()
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
    assert mesh.shape == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2}
    tokens = random_tokens(cfg.vocab_size, b=4, t=8)
    want = _apply(cfg, params, tokens)
    for layout, gate_spec, down_spec in (
        ("sample", jax.P("expert", None, "tensor"), jax.P("expert", "tensor", None)),
        ("train", jax.P("expert", "fsdp", "tensor"), jax.P("expert", "tensor", "fsdp")),
    ):
        sh = model.param_shardings(cfg, mesh, layout)["layers"][0]["mlp"]
        assert sh["expert_gate"].spec == sh["expert_up"].spec == gate_spec
        assert sh["expert_down"].spec == down_spec
        assert "expert" not in jax.tree.leaves(tuple(sh["router"].spec))
    # the forward in the train layout, the one with both fsdp and expert on the expert stacks
    placed = jax.device_put(params, model.param_shardings(cfg, mesh, "train"))
    assert placed["layers"][0]["mlp"]["expert_down"].sharding.spec == down_spec
    got = jax.jit(
        sharding.under_mesh(lambda p, t: model.apply(cfg, p, t), mesh),
        out_shardings=sharding.replicated(mesh),
    )(placed, jax.device_put(tokens, sharding.batch_sharding(mesh)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_sampler_logp_equals_teacher_forced_rescore():
    """The sampler on an MoE model (its prefill and one-token decode steps route each token
    alone) records raw log-probs equal to a teacher-forced re-score of the drawn sequences
    (tests/test_sampler.py's exactness check). Catches: a decode step whose routing differs
    from the full forward's (e.g. a combine that mixes tokens of a row)."""
    cfg, params = tiny_moe()
    prompts = np.array([[5, 6, 7, 8], [0, 0, 9, 10]], np.int32)
    pmask = prompts > 0
    sc = sampler.SamplingConfig(max_new_tokens=6, num_samples=4, stop_ids=())
    out = jax.tree.map(
        np.asarray, sampler.sample(cfg, params, prompts, pmask, sc, jax.random.key(0))
    )
    tf = np.asarray(_tf_logp(cfg, params, out.sequences, out.sequence_mask))[:, prompts.shape[1] :]
    assert out.response_mask.all()
    assert np.abs(tf - out.raw_logp).max() <= 1e-5
    np.testing.assert_array_equal(out.behaviour_logp, out.raw_logp)


def test_sampler_formats_quantize_each_expert_per_output_channel():
    """int8 sampler copy: every expert stack as codes with one scale per (expert, output
    channel), the router left unquantized. Catches: expert stacks read with a dense matrix's
    input axes (one scale shared across experts)."""
    cfg, params = tiny_moe()
    mlp = precision.prepare_fn("int8")(params)["layers"][0]["mlp"]
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert mlp["expert_gate"]["scale"].shape == (e, 1, f)
    assert mlp["expert_down"]["scale"].shape == (e, 1, d)
    assert mlp["router"].dtype == jnp.bfloat16
    w = np.asarray(params["layers"][0]["mlp"]["expert_up"])
    q = mlp["expert_up"]
    back = np.asarray(q["codes"], np.float32) * np.asarray(q["scale"])
    assert np.abs(back - w).max() <= np.asarray(q["scale"]).max() / 2 + 1e-7


def test_load_balancing_loss_against_float64_and_transformers():
    """Catches: the fractions normalised per layer instead of over all layers' rows, pads
    counted, a top-k count divided by k (HF's sum_e f_e is k), the factor E missing."""
    rng = np.random.default_rng(0)
    logits = 2.0 * rng.standard_normal((3, 10, 6)).astype(np.float32)
    mask = np.array([1, 1, 1, 1, 0, 0, 1, 1, 1, 0], np.float32)
    for m in (None, mask):
        got = float(moe.load_balancing_loss(jnp.asarray(logits), 2, m))
        assert abs(got - np_load_balancing(logits, 2, m)) <= 1e-5
    uniform = moe.load_balancing_loss(jnp.zeros((2, 5, 6)), 2)
    assert abs(float(uniform) - 2.0) <= 1e-6  # a uniform router: top_k
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf = load_balancing_loss_func(
        tuple(torch.tensor(x) for x in logits), 6, 2, torch.tensor(mask).reshape(2, 5)
    )
    assert abs(float(moe.load_balancing_loss(jnp.asarray(logits), 2, mask)) - float(hf)) <= 1e-5


def test_qwen3_30b_a3b_shape_and_config_checks():
    """KNOWN_MODELS' Qwen3-30B-A3B: 48 sparse layers, 30.5B params (the model card's total).
    A config transformers cannot mean (top-k above E, LoRA on the experts) is refused, and a
    dense config has no expert params. Catches: a typo in the table, mlp_only_layers or the
    sparse step read wrong, expert fields leaking into dense models."""
    cfg = weights.config_from_hf(KNOWN_MODELS["Qwen3-30B-A3B"])
    assert cfg.family == "qwen3_moe" and cfg.norm_topk_prob and cfg.head_dim == 128
    assert all(cfg.is_sparse(i) for i in range(cfg.num_layers))
    n = sum(x.size for x in jax.tree.leaves(model.abstract_params(cfg)))
    assert 30.4e9 < n < 30.6e9, n
    # transformers writes num_experts as num_local_experts
    hf = dict(KNOWN_MODELS["Qwen3-30B-A3B"])
    hf["num_local_experts"] = hf.pop("num_experts")
    assert weights.config_from_hf(hf) == cfg
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        cfg.replace(num_experts_per_tok=129)
    with pytest.raises(ValueError, match="LoRA"):
        cfg.replace(lora_rank=8)
    dense = model.ModelConfig()
    assert not any(dense.is_sparse(i) for i in range(dense.num_layers))
    assert "router" not in str(jax.tree_util.tree_structure(model.abstract_params(dense)))


def test_mesh_expert_axis():
    """The `expert` mesh axis: size 1 unless asked, -1 resolves on it, a three-size sequence
    means expert 1, and a dense model's placement ignores it. Catches: a 4-axis mesh that
    changes the dense layouts, an abstract mesh without the axis."""
    from ess_jax.memory import planner

    assert sharding.mesh_shape({"fsdp": 4}, 4) == {"data": 1, "fsdp": 4, "tensor": 1, "expert": 1}
    assert sharding.mesh_shape({"fsdp": 2, "expert": -1}, 8)["expert"] == 4
    assert sharding.mesh_shape((1, 2, 2), 4)["expert"] == 1
    assert planner.abstract_mesh({"data": 1, "fsdp": 2, "tensor": 1}).shape["expert"] == 1
    cfg = model.ModelConfig()
    one = model.param_shardings(cfg, sharding.make_mesh({"fsdp": 4, "tensor": 2}), "train")
    two = model.param_shardings(
        cfg, sharding.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2}), "train"
    )
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        assert "expert" not in jax.tree.leaves(tuple(b.spec))
        assert len(a.spec) == len(b.spec)


def test_planner_counts_every_local_expert_in_the_feed_forward_activations():
    """The memory planner's feed-forward width of an MoE model is its expert path's: the
    dense path's experts on a device times their width ([B, T, E, F] activations), the
    grouped path's top-k rows of width F + D per token, not the dense intermediate_size.
    Catches: a planner that sizes Qwen3-30B-A3B's 48 sparse layers by intermediate_size (16x
    under: it would say a run fits that does not), one that ignores the expert split over the
    `expert` mesh axis or the expert group's rows gathered on each of its ranks (4x under at
    expert 4), one that charges replicated rows (a batch that does not split) that factor (4x
    over), and one that sizes the grouped path as the dense one (16x over)."""
    from ess_jax.memory import planner, terms

    cfg = weights.config_from_hf(KNOWN_MODELS["Qwen3-30B-A3B"])
    one = planner.abstract_mesh({"data": 1, "fsdp": 4, "tensor": 1, "expert": 1})
    four = planner.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 1, "expert": 4})
    assert terms.ffn_width(cfg, one) == 128 * 768
    # expert 4: each rank's 32 experts on its expert group's rows, 4 per row of its own
    assert terms.ffn_width(cfg, four) == 4 * 32 * 768
    grouped = cfg.replace(moe_impl="grouped")
    assert terms.ffn_width(grouped, one) == 8 * (768 + 2048)
    assert terms.ffn_width(grouped, four) == 4 * 8 * (768 + 2048)
    assert terms.batch_split(64, four) == terms.batch_split(64, one) == 16  # expert: a data axis
    # rows that do not split stay whole on every rank: no expert group's factor
    assert terms.ffn_width(grouped, four, rows=2) == 8 * (768 + 2048)
    assert terms.ffn_width(grouped, four, rows=8) == 4 * 8 * (768 + 2048)
    dense = cfg.replace(num_experts=0, num_experts_per_tok=0)
    assert terms.ffn_width(dense, one) == cfg.intermediate_size
    acts = terms.train_terms(cfg, one, 1, 1024)["activations"]
    assert acts > 4 * terms.train_terms(dense, one, 1, 1024)["activations"]


@pytest.mark.parametrize(
    "lora_rank, mesh, experts, message",
    [
        (8, {"fsdp": -1}, 8, "model.lora.rank"),
        (0, {"fsdp": -1, "expert": 2}, 0, "dense model"),
        (0, {"fsdp": -1, "expert": 8}, 12, "do not divide"),
    ],
)
def test_run_checks_refuse_lora_on_experts_and_an_expert_axis_without_them(
    lora_rank, mesh, experts, message, tmp_path
):
    """experiment.validate reads the checkpoint's config.json before any weight loads: LoRA
    on an MoE model, and `mesh.expert` > 1 on a dense model or one whose experts it does not
    divide, are one-line config errors. Catches: the LoRA refusal raised only after the whole
    checkpoint has loaded (as a traceback), and expert ranks that silently repeat the same
    work."""
    from ess_jax.config.defaults import base_config
    from ess_jax.config.schema import ConfigError
    from ess_jax.rl import experiment

    hf = dict(KNOWN_MODELS["Qwen3-30B-A3B"], num_experts=experts)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    c = base_config()
    c.model.source = str(tmp_path)
    c.model.lora.rank = lora_rank
    c.mesh = dict(c.mesh, **mesh)
    with pytest.raises(ConfigError, match=message):
        experiment.validate(c)
