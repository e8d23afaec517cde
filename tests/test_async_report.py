"""experiments/async_report.py: the async experiment's lag.md (lag distribution, mean lag,
budget, queue depth, throughput per arm), through experiments/analyze.py, on synthetic rows in
a tiny results tree. Cheap: no model, no jax."""

import json

from conftest import one_line_exit
from test_collapse import analyze

ARM_ROWS = {  # arm -> seed -> (lag per step, budget per step, queue depth, step_s, push_s, tok/s)
    "p3o": {
        0: ([0, 1, 2, 2, 2, 2, 2], [2] * 7, 1, 0.5, 0.0, 100.0),
        1: ([0, 1, 1, 2, 2, 2, 2], [2] * 7, 0, 1.0, 0.25, 40.0),
    },
    "p3o_paced": {0: ([0, 0, 1, 0, 1, 0, 0], [2, 1, 0, 1, 2, 1, 1], 2, 0.25, 0.25, 10.0)},
}
# Worked out by hand from ARM_ROWS (async_report's docstring). p3o: 14 batches, 2 / 3 / 9 at
# lag 0 / 1 / 2, mean lag 21 / 14; steps 5 and 6 only: seed 0 2 steps in 2 x 0.5 s = 2.0
# steps/s and 2 x 50 tokens / 1 s, seed 1 2 steps in 2 x 1.25 s = 0.8 and 80 / 2.5 = 32:
# 1.4 ± 1.2 / sqrt(2), 66 ± 68 / sqrt(2). p3o_paced: 5 / 2 / 0 of 7, mean lag 2 / 7, budget
# 8 / 7, 2 steps in 1 s, 2 x 2.5 tokens in 1 s.
EXPECTED = [
    "| arm | seeds | batches | lag 0 | lag 1 | lag 2 | mean lag | budget | queue | steps/s "
    "| tokens/s |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
    "| p3o | 2 | 14 | 0.143 | 0.214 | 0.643 | 1.500 | 2.000 | 0.500 | 1.400 ± 0.849 "
    "| 66.0 ± 48.1 |",
    "| p3o_paced | 1 | 7 | 0.714 | 0.286 | 0.000 | 0.286 | 1.143 | 2.000 | 2.000 | 5.0 |",
]


def _write_results(root, arm_rows=ARM_ROWS, drop=None):
    for arm, seeds in arm_rows.items():
        for seed, (lags, budgets, depth, step_s, push_s, tok) in seeds.items():
            d = root / "async_actor_learner" / arm / str(seed)
            d.mkdir(parents=True)
            rows = [{"step": 0, "eval/pass@1": 0.5}]
            for step, (lag, budget) in enumerate(zip(lags, budgets)):
                row = {"step": step, "reward_mean": 0.5, "ess": 0.9, "capped_frac": 0.0}
                row.update(entropy_proxy=1.0, policy_lag=lag, lag_mean=float(lag), lag_max=lag)
                row.update(lag_budget=budget, queue_depth=depth, step_s=step_s, push_s=push_s)
                row.update(tokens_per_s=tok, sample_s=0.1, draw_s=0.2)
                rows.append({k: v for k, v in row.items() if k != drop})
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_lag_table_is_the_hand_computed_one_and_regenerates_byte_for_byte(tmp_path):
    """Catches shares that do not pool the seeds or miss a lag column up to the largest budget,
    throughput that counts the compile steps (the first 5) or leaves out the push, a tokens/s
    from tokens_per_s without its step's seconds, arms out of the experiment's declared order,
    analyze.py not writing lag.md, and output that changes between two runs: the table is
    worked out by hand from the synthetic rows, and a second analyze gives the same bytes."""
    _write_results(tmp_path)
    written = analyze.analyze(str(tmp_path))
    lag_md = tmp_path / "async_actor_learner" / "lag.md"
    assert str(lag_md) in written
    first = lag_md.read_bytes()
    assert first.decode().splitlines()[-4:] == EXPECTED
    analyze.analyze(str(tmp_path))
    assert lag_md.read_bytes() == first


def test_a_run_without_the_async_fields_is_named(tmp_path, capsys):
    """Catches a sync run's rows (no queue_depth) filed under the async experiment giving a
    KeyError or a silent table: one `error:` line naming the run and the missing field, exit 2
    as `ess_jax.main` on a user's mistake (a bare message and exit 1 before)."""
    _write_results(tmp_path, {"p3o": ARM_ROWS["p3o"]}, drop="queue_depth")
    line = one_line_exit(capsys, lambda: analyze.analyze(str(tmp_path)))
    assert line == (
        "error: async_actor_learner/p3o/0: step 0 has no queue_depth (not a train.mode 'async' "
        "run?)"
    )
