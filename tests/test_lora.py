"""LoRA (model.lora): adapters on the block matmuls, a frozen base, adapter-only training state,
checkpoints and exports (a merged HF checkpoint, a PEFT adapter that `peft` loads)."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import tiny_model_cfg
from test_train import coin_reward, tiny_config

from configs import quickstart
from ess_jax.data import char_tokenizer
from ess_jax.io import peft_adapter, weights
from ess_jax.io.checkpoint import Checkpointer
from ess_jax.memory import planner as memory
from ess_jax.model import decoder as model
from ess_jax.model import lora
from ess_jax.parallel import sharding
from ess_jax.rl import heldout, lora_policy, train
from ess_jax.rl.metrics import read_metrics
from ess_jax.sampling import precision as precision_lib
from ess_jax.sampling import sampler
from ess_jax.sampling.engine import JaxEngine

RANK, ALPHA = 4, 8.0
_logits = jax.jit(model.apply, static_argnums=0)  # one compile per config, no eager NNX


@pytest.fixture(scope="module")
def tiny():
    """The tiny model with adapters on every target, B random (as after training)."""
    cfg = lora.with_lora(tiny_model_cfg(), RANK, ALPHA, lora.TARGETS)
    base = model.init_params(lora.base_config(cfg), 0)
    adapters = lora.init_adapters(cfg, jax.random.key(1))
    key = jax.random.key(2)
    adapters = jax.tree.map(
        lambda x: x if x.any() else 0.3 * jax.random.normal(key, x.shape), adapters
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
    return cfg, base, adapters, tokens


def test_fresh_adapters_leave_the_base_model_unchanged(tiny):
    """Catches adapters that start non-zero (B must be 0) or a LoRA path that changes the base
    matmuls: a fresh LoRA model's logits must be the base model's, bit for bit."""
    cfg, base, _, tokens = tiny
    fresh = lora.init_adapters(cfg, jax.random.key(5))
    assert all(not b.any() for *_, b in lora.pairs(fresh))
    assert all(a.std() > 0 for *_, a, _ in lora.pairs(fresh))
    got = _logits(cfg, lora.join(base, fresh), tokens)
    np.testing.assert_array_equal(got, _logits(lora.base_config(cfg), base, tokens))


def test_merge_matches_float64_reference_and_the_unmerged_forward(tiny):
    """Catches a wrong scale (alpha / R), a transposed or misordered A B product on the
    head-split q / k / v ([D, H, K]) and o ([H, K, D]) weights, and a forward whose in-matmul
    adapters differ from the merged weights the sampler uses: merge against numpy float64
    W + (alpha / R) A B, then merged logits against unmerged ones."""
    cfg, base, adapters, tokens = tiny
    merged = lora.merge(cfg, base, adapters)
    n = 0
    for i, module, name, a, b in lora.pairs(adapters):
        w = np.asarray(base["layers"][i][module][name], np.float64)
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        ref = w + (ALPHA / RANK) * (a64.reshape(-1, RANK) @ b64.reshape(RANK, -1)).reshape(w.shape)
        np.testing.assert_allclose(merged["layers"][i][module][name], ref, rtol=1e-5, atol=1e-6)
        n += 1
    assert n == 2 * len(lora.TARGETS)
    unmerged = _logits(cfg, lora.join(base, adapters), tokens)
    plain = _logits(lora.base_config(cfg), merged, tokens)
    np.testing.assert_allclose(unmerged, plain, atol=2e-5)
    assert float(jnp.abs(plain - _logits(lora.base_config(cfg), base, tokens)).max()) > 0.1


def test_adapter_params_shard_like_their_base_matmul():
    """Catches adapters left replicated or given another layout than their weight: A takes the
    weight's input axes, B its output axes (q's B over the tensor axis like q's heads)."""
    mesh = jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    cfg = lora.with_lora(tiny_model_cfg(), RANK, ALPHA, ("q", "o", "down"))
    sh = model.param_shardings(cfg, mesh)
    attn = sh["layers"][0]["attn"]
    assert attn["lora"]["q"]["a"].spec[0] == attn["q"].spec[0] == "fsdp"
    assert attn["lora"]["q"]["b"].spec[1] == attn["q"].spec[1] == "tensor"
    assert attn["lora"]["o"]["a"].spec[0] == attn["o"].spec[0] == "tensor"
    assert sh["layers"][0]["mlp"]["lora"]["down"]["b"].spec[1] == "fsdp"
    assert set(sh["layers"][0]["attn"]["lora"]) == {"q", "o"}  # only the targets


def test_peft_loads_our_adapter_onto_the_hf_base_and_the_merged_export(tiny, tmp_path):
    """Catches a PEFT export that transposes A / B, misnames a module, or states another
    r / alpha: PEFT's model (HF base + our adapter) must give our logits, and so must the
    merged HF checkpoint loaded by transformers."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    cfg, base, adapters, tokens = tiny
    weights.save_hf(lora.base_config(cfg), base, tmp_path / "base")
    peft_adapter.save_peft(cfg, adapters, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    conf = json.loads((tmp_path / "adapter" / peft_adapter.CONFIG_FILE).read_text())
    assert conf["r"] == RANK and conf["lora_alpha"] == ALPHA and len(conf["target_modules"]) == 7
    ours = np.asarray(_logits(cfg, lora.join(base, adapters), tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = with_adapter(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(got, ours, atol=1e-4)

    weights.save_hf(lora.base_config(cfg), lora.merge(cfg, base, adapters), tmp_path / "merged")
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        got = m(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(got, ours, atol=1e-4)


def test_memory_plan_counts_adapters_and_their_optimizer_state_only():
    """Catches a planner that counts the optimizer state, the policy history or the reference of
    the whole model under LoRA: on one device each is a hand count of the adapters' floats
    (R (in + out) per targeted weight, 4 bytes; AdamW: two moments)."""
    c = quickstart.get_config()
    c.model.lora.rank, c.rollout.lag, c.objective.beta_kl = 8, 2, 0.1
    plan = memory.plan(c, 1, "h100", {"data": 1, "fsdp": 1, "tensor": 1})
    d, f, h, n, k = 64, 192, 4, 2, 16  # the quickstart's embedded model, 2 layers
    per_layer = 8 * ((d + h * k) * 2 + (d + n * k) * 2 + (d + f) * 2 + (f + d))
    adapters = 4 * 2 * per_layer
    assert plan.resident["adapters (f32)"] == adapters
    assert plan.resident["optimizer state"] - 2 * adapters < 64  # + AdamW's step counter
    assert plan.resident["policy history (3x)"] == 3 * adapters
    assert plan.resident["reference params"] == adapters
    c.model.lora.rank = 0
    full = memory.plan(c, 1, "h100", {"data": 1, "fsdp": 1, "tensor": 1})
    assert full.resident["optimizer state"] > 5 * plan.resident["optimizer state"]


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int4"])
def test_memory_plan_holds_one_merged_sampler_copy_in_the_sampler_format(precision):
    """Catches a planner that counts LoRA's sampler weights twice (a float32 merge beside its
    prepared copy) or in another format: the sample phase's weights are the bytes of what
    lora_policy.merged(..., precision) returns (jax.eval_shape, int4 packed at half a byte),
    for float32 the merged params themselves."""
    c = quickstart.get_config()
    c.model.lora.rank, c.rollout.precision = 8, precision
    plan = memory.plan(c, 1, "h100", {"data": 1, "fsdp": 1, "tensor": 1})
    cfg = lora_policy.lora_config(c.model, memory.model_config(c.model))
    copy = jax.eval_shape(
        lambda f, a: lora_policy.merged(cfg, f, a, precision=precision),
        *lora.split(model.abstract_params(cfg)),
    )
    nbytes = sum(
        x.size * (0.5 if x.dtype == jnp.int4 else x.dtype.itemsize) for x in jax.tree.leaves(copy)
    )
    weights = {
        k: v for k, v in plan.phases["sample"].items() if k not in ("kv_cache", "sampler_tmp")
    }
    assert weights == {f"merged sampler copy ({precision})": nbytes}


# ----------------------------------------------------------------------------- the sampler's copy


def _two_program_engine(cfg, frozen, adapters, precision):
    """The reference: the float32 merge, prepared by the sampler itself (precision.prepare_fn)."""
    engine = JaxEngine(lora.base_config(cfg), precision=precision)
    engine.update_params(0, lora_policy.merged(cfg, frozen, adapters))
    return engine


@pytest.mark.parametrize(
    "precision,base", [("float32", "compute"), ("bfloat16", "compute"), ("int4", "compute"),
                       ("bfloat16", "int4")],
)  # fmt: skip
def test_merge_into_the_sampler_format_draws_the_same_tokens_and_logps(
    tiny, precision, base, monkeypatch
):
    """Catches a fused merge + prepare whose copy differs from merging in float32 and then
    preparing (a cast before the add, int4 scales of the unmerged base) and a sampler that
    prepares the fused copy again: the copies, the sampled
    tokens and the recorded behaviour and raw log-probs must be the two-program path's, bit for
    bit, with precision.prepare_fn never called on the fused path."""
    cfg, params, adapters, _ = tiny
    cfg = cfg.replace(lora_base_precision=base)
    frozen = lora_policy.frozen_base(cfg, params)
    prompts = np.random.default_rng(0).integers(3, 96, (2, 5)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    sc = sampler.SamplingConfig(temperature=1.0, max_new_tokens=4, num_samples=2, stop_ids=())
    key = jax.random.key(3)
    ref = _two_program_engine(cfg, frozen, adapters, precision)
    want = ref.generate(prompts, mask, sc, key)
    ref_copy = ref.sampler_params()

    fused = lora_policy.engine(cfg, precision)
    fused.update_params(0, lora.join(frozen, adapters))
    src = fused.sampler_params()
    assert src.precision == precision and src.cfg == ref_copy.cfg
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(src.params), jax.device_get(ref_copy.params)
    )
    monkeypatch.setattr(precision_lib, "prepare_fn", lambda p: pytest.fail(f"prepared {p} again"))
    got = fused.generate(prompts, mask, sc, key)
    for field in ("tokens", "response_mask", "behaviour_logp"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    got_raw = sampler.sample_prepared(src, prompts, mask, sc, key).raw_logp
    want_raw = sampler.sample_prepared(ref_copy, prompts, mask, sc, key).raw_logp
    np.testing.assert_array_equal(got_raw, want_raw)


def test_a_copy_prepared_for_another_precision_is_refused(tiny):
    """Catches an engine whose copy is in another format than the one it samples in (e.g. a
    LoRA merge for rollout.precision bfloat16 drawn by eval's float32 engine): the draw and
    eval fail with a message naming both."""
    cfg, params, adapters, _ = tiny

    def bfloat16_merge(full, precision):
        return lora_policy.sampler_params(cfg, full, "bfloat16")

    src = JaxEngine(cfg, precision="float32", prepare=bfloat16_merge)
    src.update_params(0, lora.join(params, adapters))
    prompts, mask = np.ones((2, 4), np.int32), np.ones((2, 4), bool)
    with pytest.raises(ValueError, match="prepared in bfloat16, not float32"):
        src.generate(prompts, mask, sampler.SamplingConfig(), jax.random.key(0))
    ecfg = ml_collections.ConfigDict(
        dict(num_examples=0, batch_size=1, k=1, temperature=1.0, max_new_tokens=1)
    )
    tok, key = char_tokenizer(), jax.random.key(0)
    with pytest.raises(ValueError, match="prepared in bfloat16, not float32"):
        heldout.evaluate(src, [{"prompt": "1+1="}], tok, None, ecfg, (), key)


def test_sharded_merge_into_int4_matches_the_two_programs_and_their_layout():
    """Catches a fused program on a mesh whose codes or scales land in another layout than the
    sampler's own prepare of the sample-layout merge (the decode would then compile and
    communicate differently) or differ in value: 8 devices, base and adapters in the train
    layout, int4."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    cfg = lora.with_lora(tiny_model_cfg(), RANK, ALPHA, lora.TARGETS)
    frozen_sh, adapter_sh = lora.split(model.param_shardings(cfg, mesh))
    frozen = jax.device_put(model.init_params(lora.base_config(cfg), 0), frozen_sh)
    adapters = lora.init_adapters(cfg, jax.random.key(1), adapter_sh)
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # B != 0
    want = precision_lib.prepare_fn("int4")(lora_policy.merged(cfg, frozen, adapters))
    got = lora_policy.merged(cfg, frozen, adapters, precision="int4")
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), w.astype(jnp.float32))


# ----------------------------------------------------------------------------- the RL loop


def _config(**overrides):
    """test_train's tiny RL config with rank-8 adapters and an lr that moves B far from 0 in one
    update."""
    return tiny_config(**{"model.lora.rank": 8, "optim.lr": 2e-2, **overrides})


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run (lag 0) after two RL steps: its rows, base params before, and the Run."""
    run = train.Run(_config(), str(tmp_path_factory.mktemp("lora_run")))
    run.reward_fn = coin_reward
    base_before = jax.tree.map(np.asarray, run.trainer.state.frozen)
    run.trainer.history.push(0, run.trainer.state.params)
    rows = [run.rl_step(s) for s in range(2)]
    yield run, rows, base_before
    run.close()


def test_on_policy_ess_stays_one_with_merged_sampler_weights(lora_run):
    """Catches a sampler whose merged weights differ from the trainer's in-matmul adapters
    (the recorded pi_b would then not be the trained policy's): at lag 0 the float32 ESS must
    be 1 +- 1e-5, also at step 1 when the adapters are no longer zero."""
    run, rows, _ = lora_run
    for row in rows:
        assert abs(row["ess"] - 1.0) < 1e-5, row
        assert abs(row["ratio_max"] - 1.0) < 1e-5, row
    assert rows[0]["grad_norm"] > 0  # not vacuous: the adapters moved before step 1
    assert any(b.any() for *_, b in lora.pairs(run.trainer.state.params))


def test_base_is_frozen_and_the_optimizer_holds_adapters_only(lora_run):
    """Catches a base that trains (its params would move), an optimizer over the whole model
    (its moments would hold the base's shapes) and a state that leaks the base into the
    differentiated params."""
    run, _, base_before = lora_run
    jax.tree.map(
        np.testing.assert_array_equal, base_before, jax.device_get(run.trainer.state.frozen)
    )
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(run.trainer.state.params)]
    assert all(p[-3].key == "lora" and p[-1].key in ("a", "b") for p in paths)
    n_adapters = sum(x.size for x in jax.tree.leaves(run.trainer.state.params))
    assert n_adapters == lora.num_adapter_params(run.model_cfg)
    opt_sizes = [x.size for x in jax.tree.leaves(run.trainer.state.opt_state) if x.ndim > 0]
    assert sum(opt_sizes) == 2 * n_adapters  # Adam's mu and nu, adapters only


def test_checkpoints_hold_adapters_only(tmp_path):
    """Catches checkpoints that store the frozen base (its embedding would be among the saved
    arrays) or no adapters. That a LoRA run with lag 2 resumes exactly, adapters' optimizer
    state and policy history included, is tests/test_preemption.py's kill -9 test."""
    c = _config(**{"rollout.lag": 2, "train.steps": 2, "train.checkpoint_every": 2})
    full = tmp_path / "full"
    train.run(c, str(full))
    assert read_metrics(full)[-1]["policy_lag"] == 1

    ckpt = Checkpointer(str(full / "checkpoints"))
    saved = ckpt.saved_tree(ckpt.latest_step())
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved)]
    assert not any("embed" in p or "frozen" in p for p in paths), paths[:5]
    assert any("'lora'" in p for p in paths)
