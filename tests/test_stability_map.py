"""experiments/stability_map.py: the stable-cell rule, the paired t-test, Holm's correction and
the report's byte-for-byte regeneration. Cheap: synthetic metrics.jsonl rows in tmp_path."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
import analyze  # noqa: E402
import stability_map  # noqa: E402

from configs.mini import stability_map_harsh as harsh  # noqa: E402
from experiments import run_stats, stability_map_figures  # noqa: E402


def _write_run(path, rewards, pass1, pass1_step0=0.3, entropy=1.0):
    """A run of len(rewards) steps with held-out evals at step 0 and at the end."""
    os.makedirs(path, exist_ok=True)
    rows = [{"step": 0, "eval/pass@1": pass1_step0}]
    for i, r in enumerate(rewards):
        rows.append({"step": i, "reward_mean": r, "ess": 0.9, "entropy_proxy": entropy})
    rows.append({"step": len(rewards), "eval/pass@1": pass1})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


FLAT = [0.5] * 40
DIP = [0.5] * 15 + [0.0] * 10 + [0.5] * 15  # below half its peak for 9 steps, then recovers
FALL = [0.5] * 15 + [0.0] * 25  # stays below half its peak to the end: sustained


def test_stable_cell_needs_every_seed_free_of_sustained_collapse_and_heldout_drop(tmp_path):
    """Catches a rule that uses the dip criterion (a recovered dip is stable), that ignores the
    held-out criterion, or that calls a cell stable when only some of its seeds are."""
    cases = {
        "flat": ([FLAT] * 3, [0.5] * 3, True),
        "dip": ([FLAT, DIP, FLAT], [0.5] * 3, True),
        "fall": ([FLAT, FALL, FLAT], [0.5] * 3, False),
        "heldout": ([FLAT] * 3, [0.5, 0.2, 0.5], False),  # seed 1 ends below step 0's 0.3
    }
    for name, (rewards, pass1, _) in cases.items():
        for seed, (r, p) in enumerate(zip(rewards, pass1)):
            _write_run(tmp_path / name / str(seed), r, p)
    summaries = {
        name: [run_stats.run_summary(run) for run in seeds.values()]
        for name, seeds in run_stats.load_experiment(str(tmp_path)).items()
    }
    assert summaries["dip"][1]["collapse"] is not None  # the dip criterion does fire
    for name, (_, _, stable) in cases.items():
        assert stability_map.stable_cell(summaries[name]) is stable, name
    assert stability_map.stable_cell([]) is False  # no runs: not stable


def test_paired_t_p_value_by_hand():
    """Catches a one-sided p, a normal instead of a t quantile, or an unpaired test: with 2
    degrees of freedom the two-sided p of Student's t is 1 - |t| / sqrt(t^2 + 2)."""
    mean, lo, hi, p = run_stats.paired_t([0.5, 0.6, 0.7], [0.4, 0.4, 0.4])
    t = 0.2 / (0.1 / math.sqrt(3))  # differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1
    assert mean == pytest.approx(0.2)
    assert p == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)  # 0.0742
    assert (lo, hi) == pytest.approx((0.2 - 4.303 * 0.1 / math.sqrt(3), 0.2 + 0.2484), abs=1e-4)
    assert run_stats.paired_t([0.0, 0.0], [0.0, 0.0])[3] == 1.0  # both collapsed: equal
    assert run_stats.paired_t([0.75, 0.5], [0.25, 0.0])[3] == 0.0  # a constant shift
    assert math.isnan(run_stats.paired_t([0.3], [0.1])[3])  # one seed: no test


def test_holm_adjusted_p_values_by_hand():
    """Catches Bonferroni (every p times m), a step-down without the running maximum, a family
    that counts the untested (nan) comparisons, and p-values above 1."""
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max
    adjusted = run_stats.holm([0.01, 0.04, 0.03, 0.005])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
    nan_in = run_stats.holm([0.01, float("nan"), 0.04])
    assert nan_in[0] == pytest.approx(0.02) and nan_in[2] == pytest.approx(0.04)
    assert math.isnan(nan_in[1])
    assert run_stats.holm([0.6, 0.7]) == [1.0, 1.0]


def test_report_tables_and_regeneration_is_byte_identical(tmp_path, monkeypatch):
    """Catches a report or figure that changes when regenerated from the same files, analyze.py
    and stability_map.py writing different bytes, a refused cell shown as not run, a comparison
    row whose numbers or Holm family are wrong, identical runs left unmarked, and a count of
    stable objectives per condition (the map's gaps) that counts an unstable cell or whose
    denominator counts a refused cell."""
    root = tmp_path / "results"
    exp = root / "stability_map"
    for seed, shift in enumerate((0.0, 0.1, 0.2)):
        for cond in ("t0.6", "t1.5"):
            _write_run(exp / f"{cond}_p3o_cap_only" / str(seed), FLAT, 0.5 + shift)
            _write_run(exp / f"{cond}_grpo_eps0.2" / str(seed), FLAT, 0.4 + shift)
        _write_run(exp / "t0.6_p3o" / str(seed), FLAT, 0.5 + shift)  # = t0.6 cap-only's runs
        _write_run(exp / "t1.5_p3o" / str(seed), FALL, 0.0, entropy=3.0)
    monkeypatch.setattr(analyze, "figure", lambda *args: None)  # not this test's, and slow
    first = analyze.analyze(str(root))
    names = [os.path.join(root, f) for f in stability_map.FILES]
    assert set(names) <= set(first)
    assert not any("stability_map_harsh" in p for p in first)  # no harsh runs: no harsh report
    blobs = {p: open(p, "rb").read() for p in names}
    assert stability_map.write(str(root)) == names
    assert all(open(p, "rb").read() == blobs[p] for p in names)
    assert all(blobs[p][:4] == b"\x89PNG" for p in names[1:])
    text = blobs[names[0]].decode()
    assert "| p3o_full | 0 | refused |" in text  # fp8 x p3o_full: not in the grid's ARMS
    assert "| p3o | 0 | not run |" in text
    assert "| p3o | 3 | 0.000 ± 0.000 | 0: 0.000, 1: 0.000, 2: 0.000 |" in text
    assert "| 3 of 3 | 3 of 3 | 3 of 3 | 3.00 ± 0.00 | 0.9000 ± 0.0000 | no |" in text
    # family of 6: at t0.6 and t1.5 grpo - cap-only (-0.1 every seed: p 0), at t0.6 p3o - grpo
    # (+0.1: p 0) and p3o - cap-only (0 every seed: p 1); at t1.5 p3o - cap-only (d = -0.5,
    # -0.6, -0.7: t = 10.392, p = 1 - t / sqrt(t^2 + 2) = 0.00913, Holm x3 = 0.0274) and
    # p3o - grpo (t = 8.660, p = 0.01307, Holm max(x2 = 0.0261, 0.0274) = 0.0274)
    assert "| t0.6 | grpo_eps0.2 | p3o_cap_only | 3 | -0.100 [-0.100, -0.100] | 0.000 " in text
    assert "| t1.5 | p3o | p3o_cap_only | 3 | -0.600 [-0.848, -0.352] | 0.009 | 0.027 " in text
    assert "| t1.5 | p3o | grpo_eps0.2 | 3 | -0.500 [-0.748, -0.252] | 0.013 | 0.027 " in text
    assert "| t0.6 | p3o | p3o_cap_only | 3 | +0.000 [+0.000, +0.000] | 1.000 | 1.000 " in text
    assert "same runs (timing fields aside): p3o_cap_only = p3o (seeds 0, 1, 2)." in text
    assert "Holm over the 6 comparisons" in text and "corrected |" not in text
    # stable at t0.6 and t1.5, 8 not run: a tie, both widest; p3o: t0.6 stable, t1.5 not
    assert (
        "| grpo_eps0.2 | 2 | 10 | - | t1.0, t1.2, t2.0, fp8, calib, lag8, ext50, upd4 | - "
        "| widest |" in text
    )
    assert "| p3o_cap_only | 2 | 10 | - |" in text and text.count("| widest |") == 2
    assert "| p3o | 1 | 10 | t1.5 |" in text
    # per condition: t0.6 cap-only, grpo and p3o stable; t1.5 not p3o; the rest not run (gaps)
    assert "Stable objectives per condition (a condition with none is a gap in the map): " in text
    # of the condition's cells in the grid: 12 objectives, fp8 and calib refuse p3o_full
    assert "t0.6 3 of 12, t1.0 0 of 12, t1.2 0 of 12, t1.5 2 of 12, t2.0 0 of 12," in text
    assert "fp8 0 of 11, calib 0 of 11, lag8 0 of 12," in text


def test_harsh_report_opens_with_the_declared_five_and_labels_no_condition_row_corrected(
    tmp_path, monkeypatch
):
    """Catches analyze.py treating the harsh map as a table.md experiment (split_arm misreads
    calib+lag8_p3o, 101 arms in one legend) or leaving its report unwritten; a harsh report
    without the declared comparisons or whose B ignores the committed map's calib runs; a
    per-condition row with 5 seeds labelled "corrected" on the harsh map, whose only
    confirmatory family is the declared five; an entropy figure drawn for t0.6 and t1.5, which
    the harsh map has not; and stability_map.py --experiment writing other bytes than analyze."""
    root = tmp_path / "results"
    exp = root / "stability_map_harsh"
    for seed in range(5):
        for cond in harsh.CONDITIONS:
            _write_run(exp / f"{cond}_vcpo" / str(seed), FLAT, 0.5)
            falls = cond == "lag32" and seed % 2 == 0  # stable in 5, 6, 5, 6, 5 conditions
            _write_run(exp / f"{cond}_grpo_tis" / str(seed), FALL if falls else FLAT, 0.4)
        for cond in ("t1.5+lag8", "lag32"):
            _write_run(exp / f"{cond}_p3o_cap_only" / str(seed), FLAT, 0.5 + 0.02 * seed)
            _write_run(exp / f"{cond}_p3o" / str(seed), FLAT, 0.4 + 0.01 * seed, entropy=2.0)
    for seed in range(3):  # B: P3O - cap-only under the committed map's calib, -0.2 each seed
        _write_run(root / "stability_map" / "calib_p3o" / str(seed), FLAT, 0.3)
        _write_run(root / "stability_map" / "calib_p3o_cap_only" / str(seed), FLAT, 0.5)
    panels = {}
    save = stability_map_figures.save

    def spy(plt, fig, path):
        panels[os.path.basename(path)] = [
            (ax.get_title(), ax.get_legend_handles_labels()[1]) for ax in fig.axes
        ]
        save(plt, fig, path)

    monkeypatch.setattr(stability_map_figures, "save", spy)
    monkeypatch.setattr(analyze, "figure", lambda *args: None)
    files = [os.path.join(root, f) for f in stability_map.SETTINGS["stability_map_harsh"].files]
    written = analyze.analyze(str(root))
    assert set(files) <= set(written) and not (exp / "table.md").exists()
    assert "stability_map_harsh" not in (root / "summary.md").read_text()
    blobs = {p: open(p, "rb").read() for p in files}
    assert stability_map.main([str(root), "--experiment", "stability_map_harsh"]) is None
    assert all(open(p, "rb").read() == blobs[p] for p in files)
    text = blobs[files[0]].decode()
    assert text.startswith("# Harsh stability map: objective x condition")
    assert text.index("## Declared comparisons") < text.index("## Stable region per objective")
    # A1: differences 1, 0, 1, 0, 1 (mean 0.6, sd sqrt(0.3), t = sqrt(6), 4 df: p = 0.07048);
    # B: -0.2 every seed, p 0; A2, A3 and C not computable (p 1): Holm max(0, 4 x 0.07048)
    assert "| A1 vcpo - grpo_tis: stable conditions | 5 of 10 | +0.600 [" in text
    assert "| 0.0705 | 0.2819 | no |" in text
    assert "| B p3o - p3o_cap_only at calib: held-out pass@1 | 3 of 10 | -0.200 [" in text
    assert "| A2 vcpo - p3o_cap_only: stable conditions | 0 of 10 | - | - | 1.0000 | no |" in text
    assert "| t1.5+lag8 | p3o | p3o_cap_only | 5 |" in text
    assert text.count("| p3o_full | 0 | refused |") == 1  # calib+lag8 x p3o_full only
    assert "| corrected |" not in text and "every row exploratory" in text
    assert text.count("| exploratory |") == 6  # 3 objectives minus cap-only at 2 conditions
    # the same rows on the committed map's setting would be corrected: the test can fail
    m = stability_map.Map.of(run_stats.load_experiment(str(exp)))
    assert {r["status"] for r in stability_map.comparisons(m)} == {"corrected"}
    titles = [t for t, _ in panels["stability_map_harsh_entropy.png"]]
    assert titles == [f"{c}: entropy proxy (-mean logp)" for c in ("t1.5+lag8", "lag32")]
    legend = ["k3 (paper) (5)", "cap-only (none) (5)"]
    assert [labels for _, labels in panels["stability_map_harsh_entropy.png"]] == [legend] * 2
