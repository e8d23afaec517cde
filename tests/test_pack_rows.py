"""train.pack_rows: a batch's sequences packed into fixed-length rows (data/packing.py) for the
trainer's forwards and the scoring passes give the padded batch's log-probs, gradients, losses,
ESS and metrics (float32, 1e-6), for every objective and every ESS scope with micro-batches.

The references are the padded paths (`scoring.token_logprobs`, `update.step_loss_and_grad` and
`Learner.learn` without packing). The equality has two halves, tested apart so the tests stay
cheap: the packed forward gives each padded row's response log-probs and their gradient
(`test_packed_forward_*`, the tiny decoder), and the update feeds every micro-batch the packed
rows of exactly its own sequences (`test_every_objective_*`, `test_every_scope_*`, a cheap
segment-aware stand-in model whose attention mask is the decoder's, `layers.visible`). The
objectives read only the padded [B, T] grid, so given both halves no objective can tell packed
from padded; `test_learner_*` runs the whole update, scoring passes included, on the decoder.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_float32_close as _close
from conftest import learn_two_updates, synthetic_rollout, tiny_model_cfg

from ess_jax import objectives as O
from ess_jax.config import schema
from ess_jax.config.defaults import base_config
from ess_jax.data import packing
from ess_jax.model import decoder as model_lib
from ess_jax.model import layers, scoring
from ess_jax.rl import packed
from ess_jax.rl import update as U


def _padded(seed, b, p, t, vocab, short=False):
    """A padded RL batch: left-padded prompts of 1..p tokens, responses of 0..t tokens (a
    response of 0 and a whole-width one included); `short`: most sequences at most half the
    width, so several share a packed row."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, p + 1, b)
    rlen = rng.integers(0, t + 1, b)
    if short:
        plen, rlen = np.minimum(plen, max(1, p // 2)), np.minimum(rlen, max(1, t // 2))
    plen[0], rlen[0], rlen[1] = p, t, 0
    tokens = rng.integers(1, vocab, (b, p + t)).astype(np.int32)
    pos = np.arange(p + t)[None]
    mask = (pos >= p - plen[:, None]) & (pos < p + rlen[:, None])
    tokens = np.where(mask, tokens, 0).astype(np.int32)
    return tokens, mask


# ------------------------------------------------------------------ the packing itself


def test_first_fit_decreasing_is_deterministic_and_fits():
    """Catches a packer whose bins overflow, drop or repeat an item, or depend on anything but
    the lengths (longest first, ties by index: the same batch packs the same way on every host
    and rerun)."""
    lengths = [5, 3, 7, 3, 0, 2, 8, 1]
    bins = packing.first_fit_decreasing(lengths, 8)
    assert bins == [[6], [2, 7], [0, 1], [3, 5]]
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 5, 6, 7]
    with pytest.raises(ValueError, match="item 6 of length 8 exceeds the capacity 7"):
        packing.first_fit_decreasing(lengths, 7)


def test_pack_layout_segments_positions_and_index():
    """Catches packed rows whose segments or positions are wrong (positions not restarting per
    segment, two sequences sharing an id), a sequence packed into another micro-batch's or
    device's rows than the trainer's split gives it, and an index that reads a response
    position back from the wrong place."""
    b, p, t, m, d = 24, 5, 7, 3, 2
    tokens, mask = _padded(1, b, p, t, 50, short=True)
    order = np.random.default_rng(2).permutation(b)
    rows = packing.pack(tokens, mask, p, p + t, m, d, order)
    r, s = rows.tokens.shape
    n = r // (d * m)
    assert r == d * n * m and s == p + t
    # every sequence is one segment, in order, positions 0 .. len - 1
    for g in range(r):
        for seg in range(1, rows.segments[g].max() + 1):
            cols = np.flatnonzero(rows.segments[g] == seg)
            assert np.array_equal(cols, np.arange(cols[0], cols[0] + cols.size))
            assert np.array_equal(rows.positions[g, cols], np.arange(cols.size))
    assert rows.tokens[rows.segments == 0].sum() == 0
    assert (rows.segments > 0).sum() == mask.sum()
    # each row's response tokens read back from its micro-batch's packed rows
    micro_rows = [rows.tokens[k::m].reshape(-1) for k in range(m)]
    real = mask[:, p:]
    for row in range(b):
        back = micro_rows[rows.micro[row]][rows.index[row]]
        assert np.array_equal(back[real[row]], tokens[row, p:][real[row]])
    # the cell of each row: micro-batch k = its place in `order` mod M, device block d likewise
    place = np.argsort(order)
    assert np.array_equal(rows.micro, place % m)
    local_row = rows.index // s  # row within the micro-batch's D n packed rows
    for row in range(b):
        if real[row].any():
            assert local_row[row][real[row]][0] // n == place[row] // (b // d)


def test_pack_refuses_a_gap_and_a_long_sequence():
    """Catches packing a row whose real tokens have a hole (its padded forward would predict
    across the hole, the packed one would not) and a sequence longer than train.pack_length,
    which must name the field."""
    tokens, mask = _padded(3, 4, 3, 4, 20)
    holed = mask.copy()
    holed[0, 4] = False
    with pytest.raises(ValueError, match="row 0: its real tokens are not one contiguous run"):
        packing.pack(tokens, holed, 3, 7)
    with pytest.raises(schema.ConfigError, match=r"^config\.train\.pack_length: 5 is shorter"):
        packed.pack(tokens, mask, 3, 5, 1, 1)


# ------------------------------------------------------------------ the packed forward


@functools.cache
def _model(logits_chunk):
    cfg = tiny_model_cfg(num_layers=1, logits_chunk=logits_chunk)
    return cfg, model_lib.init_params(cfg, 0)


def test_packed_forward_matches_padded():
    """Catches a packed forward that lets attention cross from one packed sequence into
    another or a read-back off by one position: each would move the response log-probs,
    entropies or their gradient away from the padded forward's. (RoPE sees only position
    differences, so positions shifted per segment pass here: the layout test and the stand-in
    model's, which reads absolute positions, catch those.) logits_chunk 3: the chunked
    attention and LM head; the unchunked causal blocks run in the other tests here."""
    cfg, params = _model(3)
    b, p, t = 8, 4, 6
    tokens, mask = _padded(4, b, p, t, cfg.vocab_size, short=True)
    rows = packing.pack(tokens, mask, p, p + t, 1, 1)
    assert rows.tokens.shape[0] < b  # several sequences share a row
    arrays = {"tokens": rows.tokens, "segments": rows.segments, "positions": rows.positions}
    valid = mask[:, p:]
    w = np.random.default_rng(5).normal(size=(b, t)).astype(np.float32)

    def padded(params):
        lp, ent = scoring.token_logprobs(cfg, params, tokens, mask, True, start=p)
        return jnp.sum(w * lp) + jnp.sum(w * ent), (lp, ent)

    def packed_(params):
        lp, ent = scoring.packed_token_logprobs(cfg, params, arrays, rows.index, valid, True)
        return jnp.sum(w * lp) + jnp.sum(w * ent), (lp, ent)

    grad = jax.jit(jax.grad(padded, has_aux=True))
    grad_packed = jax.jit(jax.grad(packed_, has_aux=True))
    g, (lp, ent) = grad(params)
    g_pk, (lp_pk, ent_pk) = grad_packed(params)
    _close(lp_pk, lp)
    _close(ent_pk, ent)
    assert np.all(np.asarray(lp_pk)[~valid] == 0)
    jax.tree.map(_close, g_pk, g)


def test_packed_segments_do_not_see_each_other():
    """Catches attention across segments without the padded reference: changing every token of
        one packed sequence leaves the log-probs of the others in its row bit for bit unchanged
    (all but each segment's first column, the previous segment's prediction, which no response
    position reads)."""
    cfg, params = _model(0)
    tokens, mask = _padded(6, 8, 4, 6, cfg.vocab_size, short=True)
    rows = packing.pack(tokens, mask, 4, 10, 1, 1)
    g = int(np.argmax(rows.segments.max(-1)))  # the row with the most segments
    assert rows.segments[g].max() >= 2
    fn = jax.jit(functools.partial(scoring.packed_position_logprobs, cfg, params))
    before = np.asarray(fn(rows.tokens, rows.segments, rows.positions))
    changed = rows.tokens.copy()
    first = rows.segments[g] == 1
    changed[g, first] = (changed[g, first] + 1) % cfg.vocab_size
    after = np.asarray(fn(changed, rows.segments, rows.positions))
    # a segment's first column holds the previous segment's prediction, which nothing reads
    others = (rows.segments[g] > 1) & (rows.positions[g] > 0)
    assert np.array_equal(after[g, others], before[g, others])
    assert not np.array_equal(after[g, first], before[g, first])


# ------------------------------------------------------------------ the update's wiring

B, G, P, T, M, BLOCKS, VOCAB = 24, 4, 4, 6, 3, 2, 16  # 6 groups; cells of 4 rows
SEED, STEP = 3, 7  # the row shuffle's key: fold_in(key(SEED), STEP), as update_step draws it


def _stand_in_scores(params, tokens, segments_or_mask, positions):
    """A cheap policy with context: token c's log-prob reads the tokens its query sees (the
    decoder's own mask, `layers.visible`: causal, within its segment) and its position, so a
    packed row that lets one sequence see another, or positions that do not restart, change
    it. Per position [N, S], column 0 zero, as scoring.packed_position_logprobs."""
    s = tokens.shape[1]
    seen = layers.visible(segments_or_mask, jnp.arange(s)).astype(jnp.float32)
    h = jnp.einsum("nts,ns->nt", seen, params["u"][tokens]) + params["q"] * positions
    lp = jax.nn.log_sigmoid(h[:, :-1] + params["w"][tokens[:, 1:]])
    return jnp.pad(lp, ((0, 0), (1, 0)))


def _stand_in_logp_fn(params, mb):
    """The update's log-prob function shape (steps.logp_fn_for): packed rows when the
    micro-batch carries them, read back by its index; else the padded rows from P."""
    valid = mb["attn_mask"][:, P:]
    if packed.is_packed(mb):
        lp = _stand_in_scores(
            params, mb["packed_tokens"], mb["packed_segments"], mb["packed_positions"]
        )
        return scoring.unpack(lp, mb[packed.INDEX], valid)
    mask = mb["attn_mask"]
    lp = _stand_in_scores(params, mb["tokens"], mask, model_lib.positions_from_mask(mask))
    return jnp.where(valid, lp[:, P:], 0.0)


@functools.cache
def _update_problem():
    rng = np.random.default_rng(11)
    tokens, mask = _padded(12, B, P, T, VOCAB, short=True)
    params = {
        "w": rng.normal(size=VOCAB).astype(np.float32),
        "u": 0.3 * rng.normal(size=VOCAB).astype(np.float32),
        "q": np.float32(0.1),
    }
    loss_mask = mask[:, P:].astype(np.float32)
    loss_mask[5] = 0.0  # a sequence out of the loss (dynamic sampling)
    logp = np.asarray(_stand_in_logp_fn(params, {"tokens": tokens, "attn_mask": mask}))
    noise = lambda s: (s * rng.normal(size=(B, T))).astype(np.float32)  # noqa: E731
    adv = np.repeat(rng.normal(size=(B // G, 1)), G, 0) * np.ones((1, T))
    batch = {
        "tokens": tokens,
        "attn_mask": mask,
        "mask": loss_mask,
        "behaviour_logp": (logp + noise(0.3)) * loss_mask,
        "prox_logp": (logp + noise(0.1)) * loss_mask,
        "ref_logp": (logp + noise(0.2)) * loss_mask,
        "advantages": (adv * loss_mask).astype(np.float32),
    }
    return params, batch


def _both(config, m):
    """(padded, packed) loss, gradient and metrics of one update on the same rows."""
    params, batch = _update_problem()
    key = jax.random.fold_in(jax.random.key(SEED), STEP)
    order = packed.row_order(SEED, STEP, config, m, B, BLOCKS)
    rows = packed.pack(batch["tokens"], batch["attn_mask"], P, 0, m, BLOCKS, order)
    with_packed = {**batch, **packed.update_arrays(rows)}
    step = lambda b: U.step_loss_and_grad(_stand_in_logp_fn, params, b, config, m, key, BLOCKS, G)
    with jax.disable_jit():  # op by op: tiny arrays, and no program per objective to compile
        return step(batch), step(with_packed)


def _assert_same(padded, packed_):
    loss, grads, metrics = padded
    loss_pk, grads_pk, metrics_pk = packed_
    _close(loss_pk, loss)
    jax.tree.map(_close, grads_pk, grads)
    assert set(metrics_pk) == set(metrics)
    for k in metrics:
        _close(metrics_pk[k], metrics[k])


@pytest.mark.parametrize("name", sorted(O.OBJECTIVES))
def test_every_objective_packed_equals_padded(name):
    """Catches, for each objective, an update whose packed micro-batches hold other sequences
    than the padded ones (ess_scope "step" with 3 micro-batches, the statistics pass keeping
    the last micro-batch's forward), or whose per-sequence quantities would see a packed row
    instead of a sequence: loss, gradient and every metric equal the padded update's."""
    overrides = {"beta_kl": 0.05} if name in ("p3o", "grpo") else {}
    _assert_same(*_both(O.paper_config(name, **overrides), M))


@pytest.mark.parametrize("scope", ["microbatch", "microbatch_local", "step"])
@pytest.mark.parametrize("name", ["p3o", "gspo", "vcpo"])
def test_every_scope_packed_equals_padded(scope, name):
    """Catches packed micro-batches that ignore the micro-batch scopes' row shuffle (their
    per-micro-batch ESS and counts would then come from other sequences), for the ESS in the
    loss (p3o), a sequence-level ratio (gspo) and the per-sequence batch pass (vcpo)."""
    _assert_same(*_both(O.paper_config(name, ess_scope=scope), M))


def test_one_microbatch_packed_equals_padded():
    """Catches the unsplit update (train.num_microbatches 1) leaving its packed rows out."""
    _assert_same(*_both(O.paper_config("p3o"), 1))


# ------------------------------------------------------------------ the whole update


def _learn(pack_length, objective, rollout, cfg, params, mesh):
    """Two updates of 2 micro-batches each, padded (pack_length None) or packed."""
    new, row, _ = learn_two_updates(
        cfg, params, mesh, objective, rollout, 2, SEED, G, pack_length=pack_length
    )
    return new, row


def test_learner_packed_equals_padded():
    """Catches a packed run whose scoring passes (pi_prox, the reference) read other positions
    than the padded ones, whose host-side packing follows another row shuffle than the update
    draws from its optimizer step (the second update's differs from the first's), or that
    drops the entropy bonus: the params after two updates and every metric of the row equal
    the padded run's (p3o, ess_scope "microbatch", beta_kl and beta_ent on, 2 devices)."""
    from ess_jax.parallel import sharding

    cfg, _ = _model(0)
    mesh = sharding.make_mesh({"data": BLOCKS}, jax.devices()[:BLOCKS])
    params = model_lib.init_params(cfg, 1, model_lib.param_shardings(cfg, mesh))
    b = 2 * 16  # two updates of 16 rows: cells of 4 sequences on each of 2 devices
    tokens, mask = _padded(21, b, P, T, cfg.vocab_size, short=True)
    rollout = synthetic_rollout(tokens, mask, P, G, 22)
    objective = O.paper_config("p3o", ess_scope="microbatch", beta_kl=0.05, beta_ent=0.01)
    new, row = _learn(None, objective, rollout, cfg, params, mesh)
    new_pk, row_pk = _learn(0, objective, rollout, cfg, params, mesh)
    assert set(row_pk) - set(row) == {"pad_frac_packed", "pad_frac_padded"}
    assert row_pk["pad_frac_packed"] < row_pk["pad_frac_padded"]
    for k in row:
        _close(row_pk[k], row[k])
    jax.tree.map(_close, new_pk, new)
    assert not np.allclose(new["embed"], jax.device_get(params)["embed"])  # the updates moved


# ------------------------------------------------------------------ the config


@pytest.mark.parametrize(
    "field, value, names",
    [
        ("objective.kl_estimator", "full", "objective.kl_estimator='full'"),
        ("model.lora.dropout", 0.1, "model.lora.dropout"),
        ("model.routing_replay", "sampler", "model.routing_replay"),
        ("model.moe_aux_loss_coef", 0.01, "model.moe_aux_loss_coef"),
    ],
)
def test_pack_rows_refuses_what_reads_padded_rows(field, value, names):
    """Catches train.pack_rows accepted beside a pass that reads the padded rows per position
    (pi_b's full-vocabulary re-score, LoRA dropout's masks, a recorded MoE routing) or needs
    what the packed forward does not compute (the router loss), which would then silently
    differ from the padded run: one line naming both fields."""
    c = base_config()
    c.train.pack_rows = True
    section, key = field.rsplit(".", 1)
    node = c
    for part in section.split("."):
        node = node[part]
    node[key] = value
    if field == "model.lora.dropout":
        c.model.lora.rank = 4
    with pytest.raises(schema.ConfigError) as e:
        schema.check_rules(c)
    assert str(e.value).startswith("config.train.pack_rows: ") and names in str(e.value)
    assert "\n" not in str(e.value)
