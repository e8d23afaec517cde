"""The mismatch command's mixture-of-experts rows on a tiny embedded Qwen3-MoE (an HF export,
untrained): under int4 some tokens' top-k flips, the flips are counted per layer against the
trainer's own routing, and the replayed re-score's ESS and KL are computed and tabled; the
top-k comparison ignores the order within a top-k and tokens without a record."""

import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax.config.defaults import base_config
from ess_jax.io import weights
from ess_jax.mismatch import cli, report
from ess_jax.model import moe
from ess_jax.rl import experiment


@pytest.fixture(scope="module")
def moe_rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mismatch_moe")
    m = base_config().model
    m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size = 4, 2, 16
    m.hidden_size, m.intermediate_size = 32, 32
    cfg, params, tok = experiment.load_policy(m)
    weights.save_hf(cfg, params, tmp / "hf", tokenizer=tok)
    args = cli.parse_args([
        f"--model={tmp / 'hf'}", "--task=addition:digits=2", "--prompts=4", "--samples=2",
        "--max-new-tokens=4", "--chunk=4", f"--out={tmp / 'out'}",
        "--settings", "precision=int4",
    ])  # fmt: skip
    results, paths = cli.run(args, log=lambda *_: None)
    return results, paths


def test_moe_rows(moe_rows):
    """int4: a share of the routed tokens flips (0 < flip < 1, the mean of the two layers'),
    and the replayed re-score is another one than the plain (its KL differs). Catches flips
    counted against the replayed routing (always 0), a replay that ignores the record, or a
    per-layer share over the wrong tokens (the layer shares would not average to the total)."""
    results, paths = moe_rows
    m = results[0]["moe"]
    assert m["routed_tokens"] > 0
    assert len(m["flip_by_layer"]) == 2 and 0 < m["flip"] < 1
    assert m["flip"] == pytest.approx(np.mean(m["flip_by_layer"]))
    assert m["replay"]["kl_exact"] != results[0]["stats"]["all"]["kl_exact"]
    assert 0 < m["replay"]["ess_token"] <= 1
    md = open(paths["md"]).read()
    assert "## Mixture of experts: routing" in md and "top-k differs, layer 1" in md


def test_topk_differs():
    """The same experts in another order do not differ; one other expert does; a token without
    a record (moe.NOT_RECORDED) never counts."""
    own = jnp.array([[[[0, 1]], [[2, 3]], [[0, 1]]]])  # [B 1, T 3, Ls 1, X 2]
    rec = jnp.array([[[[1, 0]], [[2, 1]], [[-1, -1]]]])
    assert moe.topk_differs(own, rec).tolist() == [[[False], [True], [False]]]


def test_dense_has_no_moe_rows():
    """A dense model's results carry no "moe" entry and the report has no MoE section."""
    row = {"setting": {"label": "x"}, "stats": {"all": {}}}
    assert report.moe_markdown([row]) == []


def test_routing_flip_share_counts_routed_trained_tokens():
    """The RL metric's denominator: response tokens with a record (not each row's last, not an
    external row) and a loss mask, times the sparse layers; prompt positions never count."""
    from types import SimpleNamespace

    from ess_jax.rl.update import routing_flip_share

    routing = np.zeros((2, 5, 2, 2), np.int32)  # B 2, P 2 + T 3, Ls 2, X 2
    routing[:, 4] = moe.NOT_RECORDED  # each row's last token
    routing[1] = moe.NOT_RECORDED  # an external row
    loss_mask = np.array([[1, 1, 1], [1, 1, 1]], np.float32)
    r = SimpleNamespace(routing=routing, prompt_len=2, loss_mask=loss_mask)
    differs = np.zeros((2, 3, 2), bool)
    differs[0, 0, 1] = True  # 1 of the 2 tokens x 2 layers counted
    differs[1, :, :] = True  # the external row: not counted
    assert routing_flip_share(differs, r) == 0.25
