"""bench/gpu.py (the bench at Qwen2.5-1.5B's dimensions, for a GPU): both sides describe
the same architecture, its headline figures are the recorded measurements' (recomputed here),
and its smoke run (--tiny, any machine; torch.compile left out) measures every section.
No timing is asserted: on a shared CPU timings mean nothing.
"""

import dataclasses
import json
import math
import os
import tempfile

import jax
import numpy as np
import pytest

from bench import common as bench_common
from bench import gpu as bench_gpu
from bench import gpu_report as bench_gpu_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("sizes", [bench_gpu.TINY, bench_gpu.QWEN25_1_5B], ids=["tiny", "1.5b"])
def test_both_sides_build_the_same_architecture(sizes):
    """Catches the ess_jax config and the Hugging Face peer drifting apart (a missing qkv bias,
    untied embeddings, another head count): the HF model's config read by ess_jax's own
    importer must give bench_gpu's config, and the HF parameter count ess_jax's. At 1.5B this
    is checked on the configs and abstract shapes only (nothing allocated)."""
    pytest.importorskip("torch")
    from ess_jax.io import weights
    from ess_jax.model import decoder as model

    hf = bench_gpu.hf_qwen2(sizes, "meta")
    ours = bench_gpu.model_config(sizes)
    theirs = weights.config_from_hf(hf.config.to_dict()).replace(dtype="bfloat16")
    keep = ("pad_token_id", "bos_token_id", "eos_token_id")  # the bench sets no stop token
    assert theirs.replace(**{k: getattr(ours, k) for k in keep}) == ours
    n_abstract = sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params(ours)))
    assert n_abstract == sum(p.numel() for p in hf.parameters())
    # the FLOP model's matmul weights: everything but the norm vectors and the qkv biases
    d, n, k = sizes.dim, sizes.kv_heads, sizes.head_dim
    small = sizes.layers * (2 * d + (sizes.heads + 2 * n) * k) + d
    assert bench_common.matmul_params(sizes) == n_abstract - small


def test_train_batch_and_decode_floor_by_hand():
    """Catches advantages not zero-mean per group of 4, a loss mask over position 0, behaviour
    log-probs set on masked positions, and a wrong byte count in the bandwidth floor."""
    s = bench_gpu.TINY
    b = bench_gpu.train_batch(dataclasses.replace(s, train_batch=8))  # two groups of 4
    assert b["tokens"].shape == (8, s.train_seq)
    assert not b["mask"][:, 0].any() and b["mask"].sum(1).min() >= s.train_seq // 2 - 1
    assert (b["behaviour_logp"][b["mask"] == 0] == 0).all()
    assert (b["advantages"][b["mask"] == 0] == 0).all()
    per_row = b["advantages"][:, 1]  # position 1 is inside every row's loss mask
    assert np.abs(per_row).max() > 0.5  # not all-equal rewards: the sum below tests something
    assert np.allclose(per_row.reshape(2, 4).sum(1), 0, atol=1e-5)
    # 2-layer tiny model: weights 2 bytes each; K and V: batch * layers * 2 * N * K * keys * 2
    kv = 4 * 2 * 2 * 2 * 16 * 100 * 2
    want = (2 * bench_common.matmul_params(s) + kv) / 1e12
    assert np.isclose(bench_gpu_report.decode_floor_s(s, 4, 100, 1000.0), want)


@pytest.fixture(scope="module")
def smoke():
    pytest.importorskip("torch")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.json")
        rc = bench_gpu.main(["--tiny", "--no-compile", "--json", path, "--md", path + ".md"])
        out = json.load(open(path))
        out["rc"], out["markdown"] = rc, open(path + ".md").read()
    return out


def test_smoke_run_measures_every_section_and_reports_from_it(smoke):
    """Catches a part that crashed or measured nothing (a missing or non-positive figure), a
    headline wired to the wrong measurement (recomputed here from the recorded times), a
    recompilation inside the timed loops, the micro-batched P3O / GRPO steps missing or asked
    for at one micro-batch (what the step then ran is jax_trainer's, not checked here), and
    the fused-attention section missing or asking for the wrong implementation off the GPU
    (its "xla" twin; its first loss agrees with the einsum step's to bf16 rounding, a sanity
    check: that the fused path runs and matches is tests/test_attention_impl.py's)."""
    s = bench_gpu.TINY
    assert smoke["rc"] == 0
    head, jx, th = smoke["headline"], smoke["details"]["jax"], smoke["details"]["torch"]
    for key in (
        "train_p3o_mfu",
        "train_vs_torch",
        "decode_b4_ms",
        "decode_vs_hf_b4",
        "decode_b4_of_bandwidth",
        "copy_gbps",
        "bf16_ceiling_tflops",
    ):
        assert math.isfinite(head[key]) and head[key] > 0, (key, head[key])
    assert set(jx["train"]) == {"p3o", "grpo", "p3o_fused", "p3o_mb", "grpo_mb"}
    assert {k: v["num_microbatches"] for k, v in jx["train"].items()} == {
        "p3o": 1,
        "grpo": 1,
        "p3o_fused": 1,
        "p3o_mb": bench_gpu.ESS_MICROBATCHES,
        "grpo_mb": bench_gpu.ESS_MICROBATCHES,
    }
    assert set(th["train"]) == {"torch_eager"}
    assert jx["train"]["p3o_fused"]["attention_impl"] == "xla"
    assert np.isclose(jx["train"]["p3o_fused"]["loss"], jx["train"]["p3o"]["loss"], rtol=1e-2)
    fused = np.median(jx["train"]["p3o_fused"]["seconds"])
    assert all(v["finite"] and v["compiles_while_timed"] == [] for v in jx["train"].values())
    assert jx["decode"]["4"]["compiles_while_timed"] == []
    p3o, grpo = (np.median(jx["train"][k]["seconds"]) for k in ("p3o", "grpo"))
    assert np.isclose(head["ess_overhead"], p3o / grpo - 1)
    p3o_mb, grpo_mb = (np.median(jx["train"][k]["seconds"]) for k in ("p3o_mb", "grpo_mb"))
    assert np.isclose(head["ess_overhead_mb"], p3o_mb / grpo_mb - 1)
    # the same batch and weights: one micro-batch or four, the first loss is the same
    assert np.isclose(jx["train"]["p3o_mb"]["loss"], jx["train"]["p3o"]["loss"], rtol=1e-2)
    assert np.isclose(head["fused_attention_speedup"], p3o / fused)
    assert np.isclose(
        head["train_vs_torch"], np.median(th["train"]["torch_eager"]["seconds"]) / p3o
    )
    ceiling = max([*jx["gemm_tflops"].values(), *th["gemm_tflops"].values()])
    flops = bench_common.train_flops(s, s.train_batch, s.train_seq)
    assert np.isclose(head["train_p3o_mfu"], flops / p3o / (ceiling * 1e12))
    step = np.median([r["decode"] for r in jx["decode"]["4"]["rounds"]]) / (s.gen - 1)
    hstep = np.median([r[f"decode@{s.gen}"] for r in th["decode"]["4"]["rounds"]]) / (s.gen - 1)
    assert np.isclose(head["decode_vs_hf_b4"], hstep / step)
    assert "| ess_jax train over best torch peer |" in smoke["markdown"]
    assert "| P3O step, einsum attention over xla (above 1: fused faster) |" in smoke["markdown"]
    assert (
        "| ESS overhead at 4 micro-batches (step scope), P3O over GRPO - 1 |" in smoke["markdown"]
    )
    assert "a tiny smoke model" in smoke["markdown"]


def test_torch_part_keeps_jax_off_the_gpu(monkeypatch):
    """Catches the torch part's process letting jax take the GPU: it builds its batch with
    jnp, and jax's default preallocation (75% of the device) would leave torch a quarter of
    the memory its 1.5B train step needs. The jax part keeps the caller's platform choice.
    (The suite itself runs with JAX_PLATFORMS=cpu, so the caller's choice is set here.)"""
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert bench_gpu.part_env("torch")["JAX_PLATFORMS"] == "cpu"
    assert bench_gpu.part_env("jax")["JAX_PLATFORMS"] == "cuda"


def test_sections_name_what_runs_and_reject_unknown_names():
    """Catches --sections being ignored for the optional sections (a named GRPO step skipped
    for want of budget, the ESS overhead then missing) or the budget rule lost by default,
    and a misspelt section silently running nothing."""
    every = bench_gpu.SECTIONS
    assert bench_gpu.wanted(("train", "grpo"), "grpo", time_left=False)
    assert not bench_gpu.wanted(every, "grpo", time_left=False)
    assert bench_gpu.wanted(every, "grpo", time_left=True)
    assert not bench_gpu.wanted(("train",), "grpo", time_left=True)
    with pytest.raises(SystemExit):
        bench_gpu.main(["--tiny", "--sections", "train,grpp"])


def test_dry_run_lowers_every_program_for_cuda_with_cudnn_where_asked():
    """bench/gpu_lower.py, the no-device check to run before a GPU run: catches a program of
    bench_gpu left out of the dry run or not lowering for CUDA (a sequence length or
    layout jax's cuDNN checks refuse), the cuDNN variants reaching no cuDNN call (or the einsum
    ones reaching it), the stubbed cuDNN version check left in place after the dry run, and a
    miscounted bias gradient (the pinned jax 0.10.2 always computes it; 0.11.2, the GPU
    machine's, not for fused_attention's boolean mask: checked by hand, BENCHMARKS_GPU.md)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from bench import gpu_lower

    real = fa.check_cudnn_version
    out = gpu_lower.lower_all(bench_gpu.TINY)
    assert fa.check_cudnn_version is real
    layers, m = bench_gpu.TINY.layers, bench_gpu.ESS_MICROBATCHES
    calls = {name: (r["fwd"], r["bwd"]) for name, r in out.items()}
    assert calls == {
        "train p3o einsum M=1": (0, 0),  # bench_gpu's sections train, grpo, train_fused
        "train grpo einsum M=1": (0, 0),
        "train p3o cudnn M=1": (layers, layers),
        f"train p3o einsum M={m}": (0, 0),  # ess_microbatched
        f"train grpo einsum M={m}": (0, 0),
        # statistics scan, the kept last micro-batch, the gradient scan (a body counts once)
        f"train p3o cudnn M={m} (extra)": (3 * layers, 2 * layers),
        "prefill einsum batch 4 x 16": (0, 0),  # decode (bench_decode.jax_runner's programs)
        "prefill cudnn batch 4 x 16 (extra)": (layers, 0),
        "decode segment to 8": (0, 0),
    }
    call = "%0:{} = stablehlo.custom_call @__cudnn$fmhaScaleBiasSoftmaxBackward(%a) : (x) -> ({})"
    grads = ["tensor<2x4x8x16xbf16>"] * 3
    five = call.format(5, ", ".join(grads + ["tensor<2x1x8x8xbf16>", "tensor<0xui8>"]))
    four = call.format(4, ", ".join(grads + ["tensor<0xui8>"]))
    assert gpu_lower.cudnn_calls(five + "\n" + four) == {"fwd": 0, "bwd": 2, "bwd_with_dbias": 1}
