"""The memory planner (ess_jax/memory/planner.py, tools/plan_memory.py) against XLA's own numbers.

XLA's number is argument + output + temp - alias bytes of `compiled.memory_analysis()` (per
device) of the real train step (update.make_rl_step on an abstract train state) and of the
sampler's prefill and decode programs, on 1 and 8 fake CPU devices, with and without
`logits_chunk`. XLA:CPU's default scheduler runs independent ops concurrently at the cost of
memory (up to 2x here); accelerator backends schedule for memory, so the programs are compiled
with its memory-minimising scheduler, in a subprocess (XLA reads its flags once per process).
The sampler is compared in float32: XLA:CPU computes bfloat16 dots by upcasting both operands
(a float32 copy of the weights per decode step) where accelerators compute them natively. The
model shapes here are not those the planner's coefficients were fitted on.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.25
MODEL = dict(vocab_size=3000, hidden_size=96, intermediate_size=320, num_layers=3, num_heads=6,
             num_kv_heads=2, head_dim=16)  # fmt: skip
OPTIM = {"lr": 1e-5, "max_grad_norm": 1.0, "schedule": "constant"}
# model.lora.dropout's cases: three targets (its coefficient is fitted on all seven)
DROPOUT_CASE = dict(devices=8, rows=16, prompt=32, response=224, chunk=48, dtype="float32", lora=8,
                    targets=("q", "v", "down"))  # fmt: skip
TRAIN_CASES = [  # devices, rows (global), prompt width, response tokens, logits_chunk, dtype
    dict(devices=1, rows=2, prompt=32, response=224, chunk=0, dtype="float32"),
    dict(devices=8, rows=16, prompt=32, response=224, chunk=0, dtype="float32"),
    dict(devices=8, rows=16, prompt=32, response=224, chunk=48, dtype="bfloat16"),
    # objective.kl_estimator "full": the step re-scores pi_b (lagged params, its third argument).
    # (On 1 device the chunked step's estimate runs ~35% high with or without it: not a case.)
    dict(devices=8, rows=16, prompt=32, response=224, chunk=48, dtype="bfloat16", full=True),
    # model.lora: a frozen base (TrainState.frozen), adapters and their AdamW state only
    dict(devices=1, rows=2, prompt=32, response=224, chunk=0, dtype="float32", lora=8),
    # model.lora.base_precision: the frozen base's block matrices as int4 codes (QLoRA); on one
    # device the step holds their dequantized copy, with FSDP the gathered weights (and the
    # adapters' terms sharded as plain LoRA's)
    dict(devices=1, rows=2, prompt=32, response=224, chunk=0, dtype="float32", lora=8, base="int4"),
    dict(
        devices=8, rows=16, prompt=32, response=224, chunk=48, dtype="float32", lora=8, base="int4"
    ),
    # model.lora.dropout: its masks and dropped inputs, kept for the backward; with and without
    dict(**DROPOUT_CASE, dropout=0.1),
    dict(**DROPOUT_CASE, dropout=0.0),
]
SAMPLE_CASES = [  # devices, prompts, samples per prompt, bucketed prompt width, new tokens
    dict(devices=1, prompts=4, samples=3, prompt=128, new=96, chunk=0, precision="float32"),
    dict(devices=8, prompts=16, samples=4, prompt=128, new=96, chunk=32, precision="float32"),
]
# the scoring pass (steps.score_fn: pi_prox / reference log-probs, forward only) over `rows`
# rows in `chunks` strided chunks; its coefficients are fitted on another model's shapes
SCORE_CASES = [
    dict(devices=1, rows=4, prompt=32, response=224, chunk=0, dtype="float32", chunks=2),
    dict(devices=8, rows=32, prompt=32, response=224, chunk=48, dtype="bfloat16", chunks=2),
    dict(devices=8, rows=32, prompt=64, response=960, chunk=128, dtype="bfloat16", chunks=4),
]
# model.lora's sampler copy: base + adapters merged straight into the sampler's format
# (rl/lora_policy.merged), the base in the train layout, the copy in the sample layout
# (each format on one mesh: the format sets the output, the mesh which matrix is the largest)
MERGE_CASES = [dict(mesh={}, precision="bfloat16"),
               dict(mesh={"fsdp": 4, "tensor": 2}, precision="int4")]  # fmt: skip


def _xla_total(compiled) -> int:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _train_case(case):
    import jax
    import jax.numpy as jnp

    from ess_jax import objectives as O
    from ess_jax.memory import planner as memory
    from ess_jax.model import decoder as model
    from ess_jax.model import lora
    from ess_jax.parallel import sharding
    from ess_jax.rl import update
    from ess_jax.rl.full_kl import HISTORY, FullKL
    from ess_jax.rl.optim import make_optimizer
    from ess_jax.sampling import rescore

    model_cfg = model.ModelConfig(**MODEL, dtype=case["dtype"], logits_chunk=case["chunk"])
    if case.get("lora"):
        base = case.get("base", "compute")
        dropout, targets = case.get("dropout", 0.0), case.get("targets", lora.TARGETS)
        model_cfg = lora.with_lora(model_cfg, case["lora"], 16.0, targets, base, dropout)
    mesh = sharding.make_mesh({"fsdp": case["devices"]}, jax.devices()[: case["devices"]])
    tx = make_optimizer(OPTIM)
    with_sh = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    params = jax.tree.map(
        with_sh, model.abstract_params(model_cfg), model.param_shardings(model_cfg, mesh, "train")
    )
    frozen, trained = lora.split(params) if case.get("lora") else (None, params)
    state, state_sh = _abstract_state(trained, OPTIM, frozen)
    b, p, t = case["rows"], case["prompt"], case["prompt"] + case["response"]
    bsh = sharding.batch_sharding(mesh)
    batch = {"tokens": jnp.int32, "attn_mask": bool, "mask": jnp.float32,
             "behaviour_logp": jnp.float32, "advantages": jnp.float32}  # fmt: skip
    batch = {
        k: jax.ShapeDtypeStruct((b, t if k in ("tokens", "attn_mask") else t - p), dt, sharding=bsh)
        for k, dt in batch.items()
    }
    full = case.get("full", False)
    objective_cfg = O.ObjectiveConfig(kl_estimator="full" if full else "k3")
    args, key, behaviour_sh = (state, batch), update.StepKey(p), None
    if full:  # re-scored with other (e.g. lagged) params: the step's third argument
        behaviour_sh = {"policy": model.param_shardings(model_cfg, mesh, "train")}
        key = update.StepKey(p, FullKL(rescore.Behaviour(), HISTORY))
        args = (state, batch, {"policy": params})
    ucfg = update.UpdateConfig(model_cfg, objective_cfg, tx)
    step = update.make_rl_step(ucfg, key, state_sh, bsh, behaviour_sh)
    xla = _xla_total(step.lower(*args).compile())
    amesh = memory.abstract_mesh(sharding.mesh_shape({"fsdp": case["devices"]}, case["devices"]))
    terms = memory.train_terms(model_cfg, amesh, b, t, int(full), scored_len=case["response"])
    resident = (
        (1 + full) * memory.param_bytes(model_cfg, amesh, "train")  # + the behaviour params
        + memory.optimizer_bytes(model_cfg, amesh, OPTIM)
        + memory.tree_bytes(list(batch.values()), [bsh] * len(batch))
    )
    return {
        "xla": xla,
        "estimate": resident + sum(terms.values()),
        "transient": sum(terms.values()),
        "lora_dropout": terms.get("LoRA dropout", 0.0),
    }


def _abstract_state(params, optim, frozen=None):
    from ess_jax.memory import programs

    return programs.abstract_state(params, optim, frozen)


def _sample_case(case):
    import jax
    import jax.numpy as jnp

    from ess_jax.memory import planner as memory
    from ess_jax.model import decoder as model
    from ess_jax.model import kv_cache
    from ess_jax.parallel import sharding
    from ess_jax.sampling import decode, precision, sampler

    n_dev, sampler_precision = case["devices"], case["precision"]
    model_cfg = model.ModelConfig(**MODEL, logits_chunk=case["chunk"])
    scfg = model_cfg.replace(dtype="float32" if sampler_precision == "float32" else "bfloat16")
    mesh = sharding.make_mesh({"fsdp": n_dev}, jax.devices()[:n_dev]) if n_dev > 1 else None
    params = model.abstract_params(model_cfg)
    if mesh is not None:
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            params,
            model.param_shardings(model_cfg, mesh, "sample"),
        )
    if sampler_precision != "float32":
        params = jax.eval_shape(precision.prepare_fn(sampler_precision), params)
    st = decode.Static(max_new_tokens=case["new"], num_samples=case["samples"], greedy=False,
                       top_k=0, use_top_p=False, stop_ids=(), pad_id=0)  # fmt: skip
    prefill, dec = sampler.programs(scfg, st, mesh)
    shape = (case["prompts"], case["prompt"])
    sh = None if mesh is None else sharding.batch_sharding(mesh)
    toks = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)
    mask = jax.ShapeDtypeStruct(shape, bool, sharding=sh)
    args = (jax.random.key(0), jnp.float32(1.0), jnp.float32(1.0))
    compiled = prefill.lower(params, toks, mask, *args).compile()
    state = jax.eval_shape(prefill, params, toks, mask, *args)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state,
        compiled.output_shardings,
    )
    # the last segment attends over the whole cache: the largest of the decode programs; its
    # cache has the whole length (grown between segments; the prefill's has the first's)
    full = case["prompt"] + case["new"]
    grown = jax.eval_shape(lambda c: [kv_cache.grow_layer(layer, full) for layer in c], state.cache)
    sh = lambda x, old: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=old.sharding)
    state = state.replace(cache=jax.tree.map(sh, grown, state.cache))
    xla_decode = _xla_total(dec.segments[-1].lower(params, state, *args[1:]).compile())
    amesh = memory.abstract_mesh(sharding.mesh_shape({"fsdp": n_dev}, n_dev))
    terms = memory.sampler_terms(
        scfg,
        amesh,
        case["prompts"],
        case["samples"],
        case["prompt"],
        case["new"],
        sampler_precision,
    )
    weights = memory.sampler_copy_bytes(model_cfg, amesh, sampler_precision) or memory.param_bytes(
        model_cfg, amesh, "sample"
    )
    return {
        "prefill": {
            "xla": _xla_total(compiled),
            "estimate": weights + terms["kv_cache"] + terms["prefill"],
            "transient": terms["kv_cache"] + terms["prefill"],
        },
        "decode": {
            "xla": xla_decode,
            "estimate": weights + terms["kv_cache"] + terms["decode"],
            "transient": terms["kv_cache"] + terms["decode"],
        },
    }


def _score_case(case):
    import jax
    import jax.numpy as jnp

    from ess_jax.memory import planner as memory
    from ess_jax.memory import scoring_terms
    from ess_jax.model import decoder as model
    from ess_jax.parallel import sharding
    from ess_jax.rl import steps

    cfg = model.ModelConfig(**MODEL, dtype=case["dtype"], logits_chunk=case["chunk"])
    n_dev, rows, chunks = case["devices"], case["rows"], case["chunks"]
    mesh = sharding.make_mesh({"fsdp": n_dev}, jax.devices()[:n_dev])
    shardings = model.param_shardings(cfg, mesh, "train")
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        model.abstract_params(cfg),
        shardings,
    )
    t, bsh = case["prompt"] + case["response"], sharding.batch_sharding(mesh)
    batch = {
        k: jax.ShapeDtypeStruct((rows, t), dt, sharding=bsh)
        for k, dt in (("tokens", jnp.int32), ("attn_mask", bool))
    }
    score = steps.score_fn(cfg, case["prompt"], mesh, chunks)
    xla = _xla_total(score.lower(params, batch).compile())
    amesh = memory.abstract_mesh(sharding.mesh_shape({"fsdp": n_dev}, n_dev))
    terms = scoring_terms.score_terms(cfg, amesh, rows // chunks, t, case["response"])
    logp = jax.ShapeDtypeStruct((rows, case["response"]), jnp.float32, sharding=bsh)
    held = memory.param_bytes(cfg, amesh, "train")
    held += memory.tree_bytes([*batch.values(), logp], [bsh] * 3)
    transient = sum(terms.values())
    return {"xla": xla, "estimate": held + transient, "transient": transient}


def _merge_case(case):
    """XLA's output and temporary bytes of LoRA's merge into the sampler's format, beside the
    planner's copy, the largest float32 matrix and the whole float32 merged copy (per device,
    sample layout)."""
    import math

    import jax

    from ess_jax.memory import planner as memory
    from ess_jax.model import decoder as model
    from ess_jax.model import lora
    from ess_jax.parallel import sharding
    from ess_jax.rl import lora_policy

    fmt = case["precision"]
    sizes = sharding.mesh_shape(case["mesh"], math.prod(case["mesh"].values()))
    mesh = sharding.make_mesh(sizes, jax.devices()[: math.prod(sizes.values())])
    cfg = lora.with_lora(model.ModelConfig(**MODEL), 8, 16.0, lora.TARGETS)
    base_cfg, amesh = lora.base_config(cfg), memory.abstract_mesh(sizes)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        model.abstract_params(cfg),
        model.param_shardings(cfg, mesh, "train"),
    )
    merge = lora_policy.merge_fn(cfg, mesh, "sample", fmt)
    m = merge.lower(*lora.split(params)).compile().memory_analysis()
    abstract = jax.tree.leaves(model.abstract_params(base_cfg))
    shardings = jax.tree.leaves(model.param_shardings(base_cfg, mesh, "sample"))
    largest = max(4 * math.prod(s.shard_shape(x.shape)) for x, s in zip(abstract, shardings))
    return {
        "output": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "planned": memory.sampler_copy_bytes(base_cfg, amesh, fmt),
        "largest_f32_matrix": largest,
        "f32_copy": memory.param_bytes(base_cfg, amesh, "sample"),
        "leaves": len(jax.tree.leaves(jax.eval_shape(merge, *lora.split(params)))),
    }


def measure_all() -> None:
    """Runs in the subprocess: prints one JSON dict of every case's numbers."""
    out = {f"train{i}": _train_case(c) for i, c in enumerate(TRAIN_CASES)}
    out.update({f"score{i}": _score_case(c) for i, c in enumerate(SCORE_CASES)})
    for i, c in enumerate(SAMPLE_CASES):
        for phase, v in _sample_case(c).items():
            out[f"sample{i}_{phase}"] = v
    out["merge"] = [_merge_case(c) for c in MERGE_CASES]
    print("RESULT " + json.dumps(out))


@pytest.fixture(scope="module")
def measured():
    from conftest import xla_flags  # (the subprocess imports this module without tests/)

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = xla_flags(8, "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    code = "import tests.test_plan_memory as t; t.measure_all()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def test_estimates_within_25_percent_of_xla(measured):
    """Catches: a planner term that drifts from what XLA allocates (a missing buffer, a sharding
    the planner divides by but XLA does not apply, e.g. activations replicated over FSDP ranks,
    a chunked path that still materialises the whole [B, T, V] logits, a scoring pass planned
    without its gathered weights)."""
    measured = {k: v for k, v in measured.items() if k != "merge"}  # test_lora_merge_...
    assert len(measured) == len(TRAIN_CASES) + len(SCORE_CASES) + 2 * len(SAMPLE_CASES)
    errors = {name: (v["estimate"] - v["xla"]) / v["xla"] for name, v in sorted(measured.items())}
    for name, v in measured.items():
        # the transients the planner models (not just the params it counts exactly) are a real
        # share of XLA's total, so the comparison tests them
        assert v["transient"] > 0.3 * v["xla"], (name, v)
    bad = {k: f"{e:+.0%}" for k, e in errors.items() if abs(e) > TOLERANCE}
    assert not bad, (bad, {k: f"{e:+.0%}" for k, e in errors.items()})


def test_lora_dropout_term_is_xlas_increase(measured):
    """Catches a missing or mis-sized LoRA dropout term (the whole step's 25% tolerance cannot:
    without the term that case is still within it, -9%): the term is XLA's increase from
    dropout 0 to 0.1 on the same step, within 25% (6.6 MB planned, 6.1 MB by XLA here)."""
    with_dropout, without = (
        measured[f"train{TRAIN_CASES.index(dict(**DROPOUT_CASE, dropout=rate))}"]
        for rate in (0.1, 0.0)
    )
    assert without["lora_dropout"] == 0 and with_dropout["lora_dropout"] > 0
    increase = with_dropout["xla"] - without["xla"]
    assert abs(with_dropout["lora_dropout"] / increase - 1) < TOLERANCE, (increase, with_dropout)


def test_lora_merge_outputs_the_planned_copy_and_no_float32_model(measured):
    """Catches a planner whose LoRA sampler copy is not what lora_policy.merged(..., precision)
    outputs (another format, scales counted split where they are whole) and a merge program
    that holds the whole float32 merged model before converting it: XLA's compiled output is
    the planned copy (plus its tuple's pointer table, 8 bytes a leaf) and its temporaries at
    most one float32 matrix (+1% for the scales' reductions): a merged block matrix in bfloat16
    on one device, the embedding gathered to the sample layout before its int4 cast on fsdp 4 x
    tensor 2."""
    assert len(measured["merge"]) == len(MERGE_CASES)
    for case, m in zip(MERGE_CASES, measured["merge"]):
        assert 0 <= m["output"] - m["planned"] <= 8 * m["leaves"], (case, m)
        assert 0 < m["temp"] <= 1.01 * m["largest_f32_matrix"] < m["f32_copy"] / 3, (case, m)


def test_tool_prints_a_verdict_last(capsys):
    """Catches: a CLI that crashes on a paper config or ends without the fits / does not fit
    line a launcher can grep."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan_memory

    path = os.path.join(ROOT, "configs/paper/e1_clip_sweep.py")
    assert plan_memory.main([f"--config={path}:p3o,v5p-8"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("peak ") and (last.endswith("fits") or "DOES NOT FIT: " in last), last
    assert plan_memory.main([f"--config={path}:p3o", "--mesh=fsdp=2,tensor=4"]) == 0
    assert "'tensor': 4" in capsys.readouterr().out


Q = os.path.join(ROOT, "configs/quickstart.py")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--config=nope.py", "--device=h100", "--num_devices=1"],
         "--config nope.py: no such file nope.py"),
        ([f"--config={Q}:nope", "--device=h100", "--num_devices=1"],
         f"config file {Q}:nope: unknown arm 'nope'; this file's arms: tiny (none: the full run)"),
        ([f"--config={Q}:tiny", "--device=h900", "--num_devices=1"],
         "--device h900: unknown device; valid: h100, h200, v4, v5e, v5p, v6e, tpu7x"),
        ([f"--config={Q}:tiny", "--device=h100", "--num_devices=-2"],
         "--num_devices -2: must be >= 1"),
        ([f"--config={Q}:tiny", "--device=h100", "--num_devices=8", "--mesh=fsdp=x"],
         "--mesh fsdp=x: 'fsdp=x' is not AXIS=SIZE (e.g. fsdp=4,tensor=2; one size may be -1, "
         "the devices left)"),
        ([f"--config={Q}:tiny", "--device=h100", "--num_devices=8", "--mesh=fsdp=3"],
         "--mesh fsdp=3 on 8 devices: mesh {'data': 1, 'fsdp': 3, 'tensor': 1, 'expert': 1} needs "
         "3 devices, have 8"),
        ([f"--config={Q}:tiny", "--device=h100", "--num_devices=8", "--mesh=pipeline=8"],
         "--mesh pipeline=8 on 8 devices: unknown mesh axes ['pipeline']; valid: ('data', "
         "'fsdp', 'tensor', 'expert')"),
    ],
)  # fmt: skip
def test_tool_refuses_a_mistake_in_one_line(argv, line, capsys):
    """Catches tools/plan_memory.py ending in a traceback for a --config file that does not
    exist (FileNotFoundError) or an arm it refuses (ValueError), an unknown --device, a
    --num_devices below 1 (planned as a negative mesh), a --mesh item that is not AXIS=SIZE,
    sizes the devices do not fill or an unknown axis (ValueError): one line, exit 2."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plan_memory
    from conftest import one_line_exit

    assert one_line_exit(capsys, lambda: plan_memory.main(argv)) == "error: " + line


def test_plan_counts_the_full_kl_rescore():
    """Catches a plan that ignores objective.kl_estimator "full" (its re-score forward's logits,
    and with lag 0 and several updates per batch the params copy pi_b is re-scored with), so a
    run it says fits could run out of memory in its first update."""
    from configs.paper import e1_clip_sweep
    from ess_jax.memory import planner as memory

    c = e1_clip_sweep.get_config("p3o,v5p-8")
    c.rollout.lag, c.train.updates_per_batch = 0, 2
    base = memory.plan(c, 4, "v5p")
    c.objective.kl_estimator = "full"
    full = memory.plan(c, 4, "v5p")
    train, chunk = full.phases["train step"], c.model.logits_chunk
    assert "full KL re-score" not in base.phases["train step"]
    rows = c.data.prompts_per_step * c.rollout.group_size // 2 // c.train.num_microbatches
    per_device = rows // full.mesh["data"] // full.mesh["fsdp"]
    vocab = 151936 // full.mesh["tensor"]
    want = memory.COEF["full_kl"] * per_device * chunk * vocab * 4
    assert train["full KL re-score"] == pytest.approx(want)
    assert train["behaviour params copy"] == full.resident["params (f32)"]
    extra = full.phase_total("train step") - base.phase_total("train step")
    assert extra == pytest.approx(want + full.resident["params (f32)"])


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "fp8", "fp8_e4m3_tensor", "int8", "int4"])
def test_sampler_copy_bytes_per_format(fmt):
    """Catches a format the planner counts as another (int4 as a byte per weight, a per-tensor
    scale counted per channel, a quantized format falling back to bfloat16's two bytes): the
    planner's bytes equal those of the copy precision.prepare_params builds (jax.eval_shape),
    int4 counted packed at half a byte, on one device and split over tensor=2."""
    import jax
    import numpy as np

    from ess_jax.memory import planner as memory
    from ess_jax.model import decoder as model
    from ess_jax.sampling import precision

    cfg = model.ModelConfig(**MODEL)
    copy = jax.eval_shape(precision.prepare_fn(fmt), model.abstract_params(cfg))
    leaves = jax.tree.leaves(copy)
    nbytes = sum(
        x.size * (0.5 if x.dtype == jax.numpy.int4 else np.dtype(x.dtype).itemsize) for x in leaves
    )
    one = memory.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    assert memory.sampler_copy_bytes(cfg, one, fmt) == int(nbytes)
    two = memory.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 2})
    assert memory.sampler_copy_bytes(cfg, two, fmt) < 0.75 * nbytes  # the matrices are split


@pytest.mark.parametrize("fmt,kv", [("bfloat16", "compute"), ("float32", "bfloat16"),
                                    ("bfloat16", "fp8"), ("float32", "compute")])  # fmt: skip
def test_kv_cache_bytes_per_precision(fmt, kv):
    """Catches a planner that ignores rollout.kv_cache_precision or counts an fp8 cache
    without its per-token scales: its KV cache bytes equal those of the decode state's cache
    (the prefill's, grown to the whole length; jax.eval_shape, nothing compiled), and a
    plan with kv_cache_precision fp8 holds (1 + 4 / K) / 2 of the bfloat16 cache's bytes."""
    import jax
    import jax.numpy as jnp

    from configs.paper import e1_clip_sweep
    from ess_jax.memory import planner as memory
    from ess_jax.model import decoder as model
    from ess_jax.model import kv_cache
    from ess_jax.sampling import decode, precision

    cfg = model.ModelConfig(**MODEL)
    scfg = precision.sample_config(cfg, fmt)
    st = decode.Static(max_new_tokens=96, num_samples=3, greedy=False, top_k=0, use_top_p=False,
                       stop_ids=(), pad_id=0, kv_cache=kv)  # fmt: skip
    params = jax.eval_shape(precision.prepare_fn(fmt), model.abstract_params(cfg))
    toks = jax.ShapeDtypeStruct((4, 128), jnp.int32)
    state = jax.eval_shape(
        lambda p, t, m: decode.prefill(p, t, m, jax.random.key(0), 1.0, 1.0, cfg=scfg, st=st,
                                       mesh=None),  # fmt: skip
        params, toks, jax.ShapeDtypeStruct((4, 128), bool),
    )  # fmt: skip
    grown = jax.eval_shape(lambda c: [kv_cache.grow_layer(x, 128 + 96) for x in c], state.cache)
    want = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(grown))
    one = memory.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    got = memory.sampler_terms(scfg, one, 4, 3, 128, 96, fmt, kv)["kv_cache"]
    assert got == pytest.approx(want)

    c = e1_clip_sweep.get_config("p3o,v5p-8")
    base = memory.plan(c, 4, "v5p").phases["sample"]["kv_cache"]
    c.rollout.kv_cache_precision = "fp8"
    fp8 = memory.plan(c, 4, "v5p").phases["sample"]["kv_cache"]
    head_dim = 128  # Qwen3-4B
    assert c.rollout.precision == "bfloat16"
    assert fp8 == pytest.approx(base * (1 + 4 / head_dim) / 2)
