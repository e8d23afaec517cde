"""`model.moe_impl = "grouped"` (ess_jax/model/grouped.py): megablox's grouped matmul over each
token's top-k experts gives the dense expert path's numbers (model/moe.py), forward and gradient,
in float32 and bfloat16, with replayed routing, under expert ranks, and in the sampler (the
behaviour log-probs a replayed re-score reproduces); it compiles for a TPU slice; a run off a
TPU is refused. The kernel runs in Pallas interpret mode on this CPU (`grouped.INTERPRET`, set
here only); the TPU compile checks that the real kernel lowers.

Tolerances. float32: the two paths differ in summation order only (measured on the block
test: 4.8e-7 on outputs of size 2.8, 3e-5 on gradients of size 164; at most 3.3e-7 of each
array's largest entry): 1e-5 relative to the largest entry. bfloat16: the dense path rounds
its one (E, F) contraction once, the grouped one sums a token's X rows in float32 and rounds
once: measured equal outputs and weight gradients, the input's gradient one bfloat16 ulp apart
(0.25 at 39.75, 0.6%): 2**-6 relative to the largest entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from moe_models import tiny_moe

from configs import quickstart
from ess_jax.config.schema import ConfigError
from ess_jax.model import decoder as model
from ess_jax.model import grouped, moe, scoring
from ess_jax.parallel import sharding
from ess_jax.rl import experiment
from ess_jax.sampling import engine as engine_lib
from ess_jax.sampling import sampler

TOL = {"float32": 1e-5, "bfloat16": 2**-6}


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setattr(grouped, "INTERPRET", True)


def _close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * float(np.abs(want).max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_forward_and_gradient_match_dense_with_replayed_routing(dtype):
    """One MoE block, 2 x 12 tokens, 8 experts, top-2, a replay recording other experts for a
    third of the tokens (NOT_RECORDED for the rest): output and the gradients of the router,
    the three expert stacks and the input equal the dense path's. Catches: rows put back in
    the wrong token order (the unsort), routing weights applied to the wrong row, group sizes
    off by the row padding, a replayed routing the grouped path ignores, and gradients lost
    through the sort (the router's and the input's)."""
    cfg, _ = tiny_moe()
    cfg = cfg.replace(dtype=dtype)
    graph, state = nnx.split(moe.MoE(cfg, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (2, 12, cfg.hidden_size)).astype(dtype)
    replay = jnp.full((2, 12, 2), moe.NOT_RECORDED, jnp.int32).at[:, ::3].set(jnp.array([5, 1]))

    def loss(state, x, impl, replay):
        out, (experts, _) = nnx.merge(graph, state)(cfg.replace(moe_impl=impl), x, None, replay)
        return jnp.sum(out.astype(jnp.float32) ** 2) + out[0, 0, 0], (out, experts)

    run = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    g_dense, (out_dense, experts) = run(state, x, "dense", replay)
    g_grouped, (out_grouped, experts_grouped) = run(state, x, "grouped", replay)
    np.testing.assert_array_equal(experts_grouped, experts)
    assert (np.asarray(experts[:, ::3]) == [5, 1]).all()
    _close(out_grouped, out_dense, TOL[dtype])
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_grouped)):
        _close(b, a, TOL[dtype])
    if dtype == "float32":  # the power of the check: the replay moves the output by > 0.1
        _, (own, _) = run(state, x, "grouped", None)
        assert float(jnp.abs(own - out_grouped).max()) > 0.1


def test_the_backward_yields_the_expert_gradients_with_the_input_gradient():
    """Catches the optimization barrier of grouped.expert_ffn gone: without it the TPU compiler
    defers every layer's weight-gradient kernels (tgmm) to the end of the backward and keeps
    their inputs (dispatched tokens, their gradient, the SwiGLU rows: 2.77 GB per layer of
    Qwen3-30B-A3B on v5p-64, 17.46 GB against 12.22 GB for a 2-layer rl_step: docs/memory.md).
    In the gradient's HLO the barrier's transpose holds the input's cotangent together with
    the three stacks' (one tuple of their four shapes), so neither leaves before the other."""
    d, f, e, k = 16, 8, 4, 2
    x = jax.random.normal(jax.random.key(0), (2, 6, d))
    weights = jnp.full((2, 6, k), 0.5)
    experts = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (2, 6, k))
    stacks = [jax.random.normal(jax.random.key(i), s) for i, s in
              enumerate([(e, d, f), (e, d, f), (e, f, d)], 1)]  # fmt: skip

    def loss(x, gate, up, down):
        return jnp.sum(grouped.expert_ffn(x, weights, experts, gate, up, down) ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, *stacks).as_text()
    barriers = [line for line in hlo.splitlines() if "optimization_barrier" in line]
    shapes = ("2x6x16xf32", "4x16x8xf32", "4x16x8xf32", "4x8x16xf32")
    assert len(barriers) == 2  # the forward's, and its transpose in the backward
    assert all(all(s in line for s in shapes) for line in barriers)


@pytest.mark.parametrize("batch", [8, 4])
def test_model_log_probs_and_gradients_under_expert_ranks(batch):
    """The tiny MoE (sparse layers 0 and 2) placed on {fsdp 2, expert 4} of the fake devices
    (train layout: 2 of the 8 experts per rank): log-probs and every parameter gradient equal
    the unsharded dense path's (float32). 8 rows split over fsdp x expert (the dispatch: each
    expert group's rows gathered, the outputs reduce-scattered back); 4 rows, which do not
    split, replicated (the outputs summed over the ranks). Catches a rank computing groups
    other than its own (megablox's group_offset), a sum over the expert ranks missing or done
    twice in the backward (gradients off by a factor of 4), rows mixed up by the shard_map's
    row split, and a reduce-scatter that hands a rank another rank's rows."""
    cfg, params = tiny_moe()
    tokens = jax.random.randint(jax.random.key(2), (batch, 8), 1, cfg.vocab_size)
    mask = jnp.ones(tokens.shape, bool).at[1, :3].set(False)

    def logp_and_grad(cfg, params, tokens, mask):
        def loss(p):
            lp = scoring.token_logprobs(cfg, p, tokens, mask)
            return jnp.sum(lp * jnp.arange(lp.shape[1])), lp

        return jax.grad(loss, has_aux=True)(params)

    g_dense, lp_dense = jax.jit(logp_and_grad, static_argnums=0)(cfg, params, tokens, mask)
    mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
    placed = jax.device_put(params, model.param_shardings(cfg, mesh, "train"))
    rows = sharding.batch_sharding(mesh) if batch == 8 else sharding.replicated(mesh)
    grouped_cfg = cfg.replace(moe_impl="grouped")
    step = jax.jit(sharding.under_mesh(lambda *a: logp_and_grad(grouped_cfg, *a), mesh))
    g, lp = step(placed, jax.device_put(tokens, rows), jax.device_put(mask, rows))
    _close(lp, lp_dense, TOL["float32"])
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g)):
        _close(b, a, TOL["float32"])


def test_sampler_and_replayed_rescore_agree_on_the_grouped_path():
    """The sampler on the grouped path (prefill and one-token decode steps through the
    kernel) records routing and behaviour log-probs that a teacher-forced re-score, also
    grouped, replaying that routing reproduces (<= 1e-5, float32), while the same routing one
    sparse layer off does not (> 0.1). Catches a decode step whose grouped rows mix tokens of
    different rows, and the grouped path dropping the replayed experts."""
    cfg, params = tiny_moe()
    cfg = cfg.replace(moe_impl="grouped")
    prompts = np.array([[5, 6, 7, 8], [0, 0, 9, 10]], np.int32)
    sc = sampler.SamplingConfig(temperature=0.9, max_new_tokens=5, num_samples=2, stop_ids=())
    engine = engine_lib.JaxEngine(cfg)
    engine.update_params(0, params)
    gen = engine.generate(prompts, prompts > 0, sc, jax.random.key(1))

    def gap(routing):
        scored = engine.score(gen.sequences, gen.sequence_mask, prompts.shape[1], sc, routing)
        return float(np.abs(scored - gen.behaviour_logp)[gen.response_mask].max())

    assert gen.response_mask.all()
    assert gap(gen.routing) <= 1e-5
    assert gap(np.roll(gen.routing, 1, axis=2)) > 0.1


def test_forward_and_backward_compile_for_tpu():
    """The real kernel (not interpret mode) lowered and compiled by libtpu for v5p:2x2x1,
    {fsdp 2, expert 2}, the tiny MoE widened to D = F = 128 (TPU tiles), bfloat16 log-probs'
    gradient at the tests' "highest" matmul precision. Catches a kernel call that does not
    lower for TPU (a block shape Mosaic refuses; a bfloat16 product at "highest": "Bad lhs
    type"), one GSPMD must partition (the shard_map dropped: "Mosaic kernels cannot be
    automatically partitioned"), and a sparse layer left on the dense path. Nine kernel calls
    per sparse layer: gate, up and down forward, then each one's input and weight gradients."""
    from ess_jax.memory import tpu

    cfg, _ = tiny_moe()
    cfg = cfg.replace(
        hidden_size=128, intermediate_size=128, moe_intermediate_size=128, dtype="bfloat16"
    ).replace(moe_impl="grouped")
    mesh = sharding.make_mesh({"fsdp": 2, "expert": 2}, tpu.topology_devices("v5p:2x2x1"))
    rows = NamedSharding(mesh, PartitionSpec(sharding.BATCH, None))
    tokens = jax.ShapeDtypeStruct((4, 16), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((4, 16), jnp.bool_, sharding=rows)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        model.abstract_params(cfg),
        model.param_shardings(cfg, mesh),
    )
    grad = jax.grad(lambda p, t, m: jnp.sum(scoring.token_logprobs(cfg, p, t, m)))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(grouped, "INTERPRET", False)
        text = jax.jit(sharding.under_mesh(grad, mesh)).lower(params, tokens, mask).compile()
    assert text.as_text().count("tpu_custom_call") == 9 * 2


def test_grouped_is_refused_off_the_tpu_and_on_a_dense_model(monkeypatch):
    """The kernel lowers for TPUs only: a run asking for it on the CPU must say so in one line
    before compiling, not fail inside Mosaic; on a TPU it is refused for a dense model (no
    experts: a knob that would silently do nothing) and accepted for an MoE one."""
    c = quickstart.get_config("tiny")
    c.model.moe_impl = "grouped"
    msg = r"^config\.model\.moe_impl: 'grouped' runs on TPUs only; this run's backend"
    with pytest.raises(ConfigError, match=msg + r" is 'cpu' \(use 'dense'\)$"):
        experiment.validate(c)
    monkeypatch.setattr(experiment.jax, "default_backend", lambda: "tpu")
    with pytest.raises(ConfigError, match=r"dense model \(no experts to group\); use dense"):
        experiment.validate(c)
    c.model.num_experts = 4
    experiment.validate(c)  # an MoE on a TPU: accepted
