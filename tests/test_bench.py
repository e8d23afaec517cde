"""bench/cpu.py: its smoke run (--quick --tiny) writes the headline ratios, both sides of
each comparison hold the same model and do the same work, and the FLOP count behind MFU
counts every matmul weight. No timing is asserted: on a shared CPU timings mean nothing.
torch.compile is left out here (--no-compile): its cold compile alone takes minutes.
"""

import json
import math
import os

import numpy as np
import pytest

from bench import common as bench_common
from bench import cpu as bench
from bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


HEADLINE = ("train_vs_torch", "train_mfu", "decode_vs_hf_b32", "decode_len_scaling")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    pytest.importorskip("torch")  # the peers are PyTorch models
    path = tmp_path_factory.mktemp("bench")
    argv = ["--quick", "--tiny", "--no-compile", "--json", str(path / "b.json")]
    bench.main([*argv, "--md", str(path / "B.md")])
    out = json.loads((path / "b.json").read_text())
    out["markdown"] = (path / "B.md").read_text()
    return out


def test_smoke_run_writes_the_headline_ratios_from_its_measurements(smoke):
    """Catches a headline key missing, NaN / inf or <= 0 (a section that measured nothing), a
    ratio wired upside down or to the wrong measurement (recomputed here from the recorded
    rounds: the median of per-round ratios), and recompilation inside the timed loops (it
    would be timed as work)."""
    for key in HEADLINE:
        assert math.isfinite(smoke[key]) and smoke[key] > 0, (key, smoke[key])
    assert math.isfinite(smoke["ess_overhead"]) and smoke["ess_overhead"] > -1
    d, sz = smoke["details"], smoke["sizes"]
    train, rounds = d["train"]["seconds"], d["train"]["rounds"]
    assert set(train) == set(rounds) == {"ess_jax", "torch_eager"}
    per_round = np.array(rounds["torch_eager"]) / np.array(rounds["ess_jax"])
    assert len(per_round) == sz["repeats"]
    assert np.isclose(smoke["train_vs_torch"], np.median(per_round))
    assert np.isclose(train["ess_jax"], np.median(rounds["ess_jax"]))
    ceiling = max(max(v.values()) for v in d["gemm"].values())
    mfu = d["train"]["flops_per_step"] / train["ess_jax"] / (ceiling * 1e9)
    assert np.isclose(smoke["train_mfu"], mfu)
    b, n = str(max(sz["decode_batches"])), 2 * sz["gen"]
    dec = d["decode"]["rounds"]["sampled"][b]
    hf = [r[f"decode@{n}"] for r in dec["hf"]]
    ours = [r["decode"] for r in dec[f"ess_jax@{n}"]]
    assert np.isclose(smoke["decode_vs_hf_b32"], np.median(np.array(hf) / np.array(ours)))
    rl = [r["p3o M=1"]["step"] / r["grpo M=1"]["step"] for r in d["rl"]["rounds"]]
    assert np.isclose(smoke["ess_overhead"], np.median(rl) - 1)
    assert d["checks"]["compiles_while_timed"] == []
    md = smoke["markdown"]  # the report: command, versions, the table, the same headline
    assert "--quick --tiny --no-compile" in md and "transformers " in md
    assert "| train step, 4 x 16 tokens, P3O + AdamW |" in md
    assert json.loads(md.split("```json")[1].split("```")[0])["train_mfu"] == smoke["train_mfu"]


def test_both_sides_start_from_the_same_model_and_loss(smoke):
    """Catches a peer given other weights (a wrong export / import, another init seed, a torch
    copy taken after ess_jax updated) or another loss than P3O: the table would then compare
    two different computations. The bench's own checks, on the objects it timed."""
    checks = smoke["details"]["checks"]
    assert checks["logits"] < 1e-4
    assert checks["first_loss_rel"]["torch_eager"] < 1e-4


def test_identical_weights_and_matmul_param_count_independently():
    """Catches the same bugs as above should the bench's own check be broken (it compares
    torch with torch, say), and a FLOP count behind MFU that misses a matrix: every param of
    the loaded model is a matmul weight except the input embedding and the norm vectors."""
    torch = pytest.importorskip("torch")
    import jax

    from ess_jax.model import decoder as model

    s = bench.tiny(bench.QUICK)
    mesh = bench_common.one_device_mesh()
    hf, cfg, params = bench_common.build_models(s, mesh)
    tokens = np.random.default_rng(1).integers(1, s.vocab, (3, 12))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens)).logits.numpy().astype(np.float64)
    ours = np.asarray(model.apply(cfg, params, tokens), np.float64)
    assert np.max(np.abs(ours - ref)) < 1e-4
    # the check can fail: q off by 5% (a wrong scale on import) moves the logits measurably
    off = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 1.05 if getattr(path[-1], "key", None) == "q" else x, params
    )
    assert np.max(np.abs(np.asarray(model.apply(cfg, off, tokens)) - ref)) > 1e-2
    norms = (2 * s.layers + 1) * s.dim
    assert bench_common.matmul_params(s) == model.num_params(params) - s.vocab * s.dim - norms
    # hand count at these sizes (D=32 F=64 L=2 H=4 N=2 K=8 V=256, B=4, T=16):
    # N = 2 * (32*32 + 2*32*16 + 32*32 + 3*32*64) + 256*32 = 26624
    # 6 * N * 64 + 12 * L * H * K * T * 64 = 10223616 + 786432
    assert bench_common.train_flops(s, 4, 16) == 10223616 + 786432


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--set", "nope=3"], "NAME one of"),
        (["--set", "gen=x"], "gen takes integers"),
        (["--set", "gen=1"], "sizes.gen=1"),
        (["--set", "microbatches=1,3"], "3 does not divide"),
        (["--set", "decode_modes=greedy,beam"], "sizes.decode_modes"),
        (["--set", "rl_objectives=p3o"], "must hold p3o and grpo"),
    ],
)
def test_bad_sizes_are_refused_naming_the_field(argv, message):
    """Catches a bad --set that is accepted and fails minutes later (or measures the wrong
    thing), or an error that does not say which size is wrong."""
    with pytest.raises(SystemExit, match=message):
        bench.parse_args(argv)


def test_a_run_rewrites_only_its_part_of_the_report(tmp_path):
    """Catches a full run that drops BENCHMARKS.md's hand-written sections (the design
    decisions and their measurements live only there) or keeps the previous run's tables
    beside the new ones, and a BENCHMARKS.md whose markers were edited away (the next full
    run would then replace the whole file)."""
    path = tmp_path / "B.md"
    report.write_report(str(path), "tables 1")
    first = path.read_text()
    assert report.BEGIN in first and report.END in first and "tables 1" in first
    path.write_text("intro\n" + first + "\n## Design decisions\nkept\n")
    report.write_report(str(path), "tables 2\n")
    text = path.read_text()
    assert text.startswith("intro\n") and text.endswith("\n## Design decisions\nkept\n")
    assert "tables 2" in text and "tables 1" not in text
    with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
        ours = f.read()
    assert ours.count(report.BEGIN) == ours.count(report.END) == 1
    assert ours.index(report.BEGIN) < ours.index(report.END) < ours.index("## Design decisions")
