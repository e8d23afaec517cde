"""train.pack_microbatches "tokens": micro-batches cut by a token budget (data/packing.regroup,
rl/packed.py, update.Learner) instead of by rows, so that many short sequences share a packed
row across what would have been row micro-batches. The reference is the padded update: in the
"step" ESS scope (the only one the knob allows) loss, gradient and metrics do not depend on
which rows share a micro-batch, so two updates of each must leave the same params and metrics
(float32, 1e-6).
"""

import jax
import numpy as np
import pytest
from conftest import assert_float32_close as _close
from conftest import learn_two_updates, synthetic_rollout, tiny_model_cfg

from ess_jax import objectives as O
from ess_jax.config import schema
from ess_jax.config.defaults import base_config
from ess_jax.data import packing
from ess_jax.model import decoder as model_lib
from ess_jax.parallel import sharding

G, P, T, BLOCKS = 4, 4, 6, 2


def _batch(seed, b, vocab):
    """Left-padded prompts of 1..P tokens and responses of 0..T tokens, most of them short."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, P + 1, b)
    rlen = np.minimum(rng.integers(0, T + 1, b), rng.integers(1, T + 1, b))
    plen[0], rlen[0], rlen[1] = P, T, 0
    pos = np.arange(P + T)[None]
    mask = (pos >= P - plen[:, None]) & (pos < P + rlen[:, None])
    tokens = np.where(mask, rng.integers(1, vocab, (b, P + T)), 0).astype(np.int32)
    return tokens, mask


def test_microbatch_count_ladder():
    """Catches a micro-batch count below the rows needed, or one so coarse that it adds more
    than a sixteenth (the pad share it would add), or so fine that every count compiles."""
    for needed in range(1, 300):
        m = packing.microbatch_count(needed)
        assert needed <= m <= max(needed, 16) * 17 / 16, (needed, m)
    counts = {packing.microbatch_count(n) for n in range(65, 129)}
    assert len(counts) == 16  # 68, 72, ..., 128: a sixteenth of 64 apart


def test_regroup_holds_each_sequence_once_within_the_budget():
    """Catches a regroup that drops or repeats a sequence, fills a cell past the packed row's
    length, loads one device with more than one packed row over another, or leaves a dummy
    row with real tokens."""
    tokens, mask = _batch(5, 48, 16)
    length, blocks = 12, 2
    rg = packing.regroup(mask, length, blocks)
    lengths = mask.sum(-1)
    assert sorted(rg.index[rg.real].tolist()) == [i for i in range(48) if lengths[i] > 0]
    per_block, m = len(rg.index) // blocks, rg.num_micro
    used = []
    for d in range(blocks):
        rows = 0
        for k in range(m):
            cell = [g for g in range(d * per_block, (d + 1) * per_block) if g % m == k]
            load = sum(lengths[rg.index[g]] for g in cell if rg.real[g])
            assert load <= length
            rows += load > 0
        used.append(rows)
    assert max(used) - min(used) <= 1 and max(used) <= m, used
    assert not rg.take(mask)[~rg.real].any() and (rg.take(tokens)[~rg.real] == 0).all()
    pk = packing.pack(rg.take(tokens), rg.take(mask), P, length, m, blocks)
    assert pk.tokens.shape == (blocks * m, length)  # one packed row per cell
    assert int((pk.segments > 0).sum()) == int(lengths.sum())


def _learn(by_tokens, objective, rollout, cfg, params, mesh, m):
    """Two updates of `m` row micro-batches, padded, or cut by tokens from rows of 2 (P + T)."""
    packing = {"pack_length": 2 * (P + T), "pack_by_tokens": True} if by_tokens else {}
    return learn_two_updates(cfg, params, mesh, objective, rollout, m, 3, G, **packing)


def test_token_microbatches_equal_padded():
    """Catches token micro-batches that drop, repeat or mix up sequences (a dummy row left with
    a copy of a real one, an index into another cell's packed row, a regroup across devices)
    or train on another micro-batch count than they were cut for: two updates of p3o (the step
    ESS in the loss, pi_prox and the reference scored) leave the padded run's params and
    metrics, and the updates ran with fewer micro-batches than rows."""
    cfg = tiny_model_cfg(num_layers=1)
    mesh = sharding.make_mesh({"data": BLOCKS}, jax.devices()[:BLOCKS])
    params = model_lib.init_params(cfg, 1, model_lib.param_shardings(cfg, mesh))
    b = 2 * 32  # two updates of 32 rows: 8 row micro-batches of 2 rows per device
    tokens, mask = _batch(21, b, cfg.vocab_size)
    rollout = synthetic_rollout(tokens, mask, P, G, 22, dropped=[3])
    objective = O.paper_config("p3o", ess_scope="step", beta_kl=0.05)
    new, row, _ = _learn(False, objective, rollout, cfg, params, mesh, 8)
    new_tk, row_tk, learner = _learn(True, objective, rollout, cfg, params, mesh, 8)
    assert set(row_tk) - set(row) == {"pad_frac_packed", "pad_frac_padded"}
    assert row_tk["pad_frac_packed"] < 0.5 * row_tk["pad_frac_padded"]
    counts = {k.num_microbatches for k in learner.compiled}
    assert counts and all(m < 8 for m in counts), counts
    for k in row:
        _close(row_tk[k], row[k])
    jax.tree.map(_close, new_tk, new)
    assert not np.allclose(new["embed"], jax.device_get(params)["embed"])  # the updates moved


@pytest.mark.parametrize(
    "settings, names",
    [
        ({"train.pack_rows": False}, "set train.pack_rows=True"),
        ({"objective.ess_scope": "microbatch"}, "ess_scope='microbatch'"),
        ({"objective.name": "vcpo"}, "vcpo's batch pass"),
    ],
)
def test_token_microbatches_refuse_what_reads_the_split(settings, names):
    """Catches "tokens" accepted where the split changes the numbers (an ESS per micro-batch,
    vcpo's groups) or where nothing is packed: one line naming the field."""
    c = base_config()
    c.train.pack_rows, c.train.pack_microbatches = True, "tokens"
    for field, value in settings.items():
        section, key = field.split(".")
        c[section][key] = value
    with pytest.raises(schema.ConfigError) as e:
        schema.check_rules(c)
    msg = str(e.value)
    assert msg.startswith("config.train.pack_microbatches: ") and names in msg, msg
    assert "\n" not in msg
