"""tools/compile_tpu.py and ess_jax/memory/{programs,tpu}.py: a run's programs compiled for TPU
slices on this CPU host (libtpu's ahead-of-time compiler, installed with the test extras).

A one-layer embedded model with 8 prompts x 2 samples, 4 new tokens, one SFT step and eval in
bfloat16: every kind of program a run has, each compiling in about a second.
"""

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import compile_tpu  # noqa: E402  (tools/compile_tpu.py)
import plan_memory  # noqa: E402  (tools/plan_memory.py)
import tpu_table  # noqa: E402  (tools/tpu_table.py)

TINY = """
from ess_jax.config.defaults import base_config


def get_config(arg=None):
    c = base_config()
    c.model.num_layers = 1
    c.data.prompts_per_step = 8
    c.data.buckets = (16,)
    c.rollout.group_size = 2
    c.rollout.max_new_tokens = 4
    c.objective.name = "grpo_tis"  # needs pi_prox: the scoring pass is a program
    c.sft.steps = 1
    c.sft.seq_len = 16
    c.sft.batch_size = 8
    c.eval.every = 1
    c.eval.batch_size = 4
    c.eval.k = 2
    c.eval.max_new_tokens = 4
    c.eval.precision = "bfloat16"
    return c
"""
PROGRAMS = {"rl_step", "score", "sft_step", "reshard", "sampler_copy/bfloat16", "sample/prefill",
            "sample/decode4", "eval/prefill", "eval/decode4"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny_tpu.py"
    path.write_text(TINY)
    return str(path)


def _compile(tiny, topology, out_dir, *flags):
    out = out_dir / f"{topology}.json"
    args = [f"--config={tiny}", f"--topology={topology}", f"--json={out}", *flags]
    assert compile_tpu.main(args) == 0
    return out


@pytest.fixture(scope="module")
def v5e_record(tiny, tmp_path_factory):
    """The tool's default: compiled in child processes (tests/test_tpu_isolation.py); the
    other tests compile --in-process, a child's start saved."""
    return _compile(tiny, "v5e:2x2", tmp_path_factory.mktemp("v5e"))


def test_every_program_of_a_run_compiles_for_v5e(tiny, v5e_record):
    """Catches a program of the run left out of the compile (the scoring pass, the SFT step,
    eval's sampler or its copy in eval.precision), compiler bytes that are not arguments +
    outputs + temporaries - aliases (the planner's count), a peak that leaves out what the run
    holds beside a program, and decode rows whose loop trips are not their new tokens."""
    rec = json.loads(v5e_record.read_text())
    assert (rec["topology"], rec["devices"], rec["hosts"]) == ("v5e:2x2", 4, 1)
    assert rec["device_kind"] == "TPU v5 lite" and rec["hbm_bytes"] == 16e9
    progs = rec["programs"]
    assert set(progs) == PROGRAMS
    for name, p in progs.items():
        m = p["memory"]
        assert p["compiler_bytes"] == m["argument"] + m["output"] + m["temp"] - m["alias"], name
        assert "error" not in p, name
        assert p["planner_bytes"] > 0, name  # the scoring pass's too (memory/scoring_terms.py)
    peak = max(p["compiler_bytes"] + p["beside_bytes"] for p in progs.values())
    assert rec["peak_bytes"] == peak and rec["fits"] and peak < rec["usable_bytes"]
    assert rec["only"] is None
    # the train state lives beside the sampler (the planner's bytes of params and AdamW state):
    # the sampler's rows carry it, the step's do not (it is the step's argument)
    from ess_jax.memory import planner

    plan = planner.plan(plan_memory.load_config(tiny), 4, "v5e")
    assert progs["sample/prefill"]["beside_bytes"] == pytest.approx(sum(plan.resident.values()))
    assert progs["rl_step"]["beside_bytes"] == 0
    # the reshard reads the train params: the AdamW moments stay beside it
    assert progs["reshard"]["beside_bytes"] == pytest.approx(plan.resident["optimizer state"])
    assert progs["sample/decode4"]["loop_trips"] == 3  # tokens 2..4; the prefill draws the first
    assert progs["rl_step"]["flops"] > progs["sample/decode4"]["flops"] > 0
    assert progs["rl_step"]["collectives"]["all-gather"] > 0  # FSDP gathers the weights
    assert progs["sample/prefill"]["collectives"] == {}  # the sample layout needs none


def test_collective_bytes_of_known_programs():
    """Catches a collective parser that misses an op, counts an async start's operand with its
    output, or sizes arrays wrongly: a row-sharded f32[1024, 256] gathered to every device is
    an all-gather of 1 MiB per device; its column sums, replicated, an all-reduce of 1 KiB;
    and one that cannot tell a collective in a loop body (run once per trip) from one outside."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from ess_jax.memory import tpu
    from ess_jax.parallel import sharding

    mesh = sharding.make_mesh({"fsdp": 4}, tpu.topology_devices("v5e:2x2"))
    rep = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32,
                             sharding=NamedSharding(mesh, PartitionSpec("fsdp", None)))  # fmt: skip
    gather = jax.jit(lambda x: x * 2, out_shardings=rep).lower(x).compile()
    reduce = jax.jit(lambda x: x.sum(0), out_shardings=rep).lower(x).compile()
    assert tpu.collective_bytes(gather.as_text()) == {"all-gather": 1024 * 256 * 4}
    assert tpu.collective_bytes(reduce.as_text()) == {"all-reduce": 256 * 4}

    def scan(x):  # a reduction the loop's carry depends on stays in the body; the gather not
        def body(c, xi):
            s = jax.lax.with_sharding_constraint((xi * c[None, :]).sum(0), rep)
            return jnp.tanh(s), None

        c, _ = jax.lax.scan(body, jnp.ones((256,), jnp.float32), x)
        return jax.lax.with_sharding_constraint(x[0] * 2, rep), c

    xs = jax.ShapeDtypeStruct(
        (8, 1024, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "fsdp"))
    )
    hlo = jax.jit(scan, out_shardings=(rep, rep)).lower(xs).compile().as_text()
    assert tpu.collective_bytes(hlo, in_loops=True) == {"all-reduce": 256 * 4}
    assert tpu.collective_bytes(hlo, in_loops=False) == {"all-gather": 1024 * 256 * 4}


def test_replan_recomputes_the_planner_side_and_keeps_the_compilers(v5e_record, tmp_path):
    """Catches --replan (a planner change re-read against committed compiles) that leaves a
    stale planner or beside figure, a stale peak or verdict, or touches the compiler's bytes;
    and a `fits` verdict on a record that compiled only some of the run's programs."""
    rec = json.loads(v5e_record.read_text())
    stale = json.loads(json.dumps(rec))
    for p in stale["programs"].values():
        p["beside_bytes"], p["planner_bytes"] = 1e12, 1.0
    stale["peak_bytes"], stale["fits"] = 0.0, False
    path = tmp_path / "stale.json"
    path.write_text(json.dumps(stale))
    assert compile_tpu.main(["--replan", str(path)]) == 0
    assert json.loads(path.read_text()) == rec
    # a record of some programs only (--only) gives no verdict: the others may be the largest
    part = {**rec, "programs": {"rl_step": rec["programs"]["rl_step"]}}
    path.write_text(json.dumps(part))
    assert compile_tpu.main(["--replan", str(path)]) == 0
    replanned = json.loads(path.read_text())
    assert replanned["only"] == ["rl_step"] and replanned["fits"] is None


def test_two_host_topology(tiny, tmp_path):
    """Catches a mesh laid over one host's devices only, or a host count read wrongly, when the
    topology spans two hosts (v5e:2x4: 8 chips, 2 hosts in libtpu's description)."""
    rec = json.loads(_compile(tiny, "v5e:2x4", tmp_path, "--in-process").read_text())
    assert (rec["devices"], rec["hosts"]) == (8, 2)
    assert rec["mesh"] == {"data": 1, "fsdp": -1, "tensor": 1, "expert": 1}
    assert all("error" not in p for p in rec["programs"].values()) and rec["fits"]


def test_external_behaviour_model_programs(tmp_path):
    """Catches E7's external sampler left out of the compile (its Qwen3-8B prefill and decode
    are the largest sampler programs of the arm), built with the policy's shapes instead of
    the external checkpoint's, or sampling before its copy in rollout.external_precision."""
    ext = tmp_path / "ExternalModel"
    ext.mkdir()
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=96,
              intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=1e4, max_position_embeddings=256,
              tie_word_embeddings=False, rms_norm_eps=1e-5)  # fmt: skip
    (ext / "config.json").write_text(json.dumps(hf))
    cfg = tmp_path / "tiny_external.py"
    cfg.write_text(
        TINY.replace("c.rollout.group_size = 2", "c.rollout.group_size = 4").replace(
            "    return c",
            f"    c.rollout.external_fraction = 0.5\n    c.rollout.external_checkpoint = "
            f"{str(ext)!r}\n    c.rollout.external_precision = 'bfloat16'\n    return c",
        )
    )
    out = tmp_path / "ext.json"
    args = [f"--config={cfg}", "--topology=v5e:2x2", f"--json={out}", "--only=external/decode4",
            "--in-process"]  # fmt: skip
    assert compile_tpu.main(args) == 0
    progs = json.loads(out.read_text())["programs"]
    assert set(progs) == {"external/sampler_copy/bfloat16", "external/prefill",
                          "external/decode4"}  # fmt: skip
    assert all("error" not in p and p["planner_bytes"] > 0 for p in progs.values())
    assert progs["external/decode4"]["loop_trips"] == 3
    # the external model's own shapes: its 2 layers x 96 wide, bfloat16, two of each 4 samples
    import jax

    from ess_jax.memory import programs, tpu
    from ess_jax.parallel import sharding as sharding_lib

    config = plan_memory.load_config(str(cfg))
    mesh = sharding_lib.make_mesh(dict(config.mesh), tpu.topology_devices("v5e:2x2"))
    by_name = {p.name: p for p in programs.run_programs(config, mesh)}
    (params,) = by_name["external/reshard"].args
    embed = [x.shape for x in jax.tree.leaves(params) if x.shape[0] == 128]
    assert embed and all(s[-1] == 96 for s in embed), embed
    assert {"sample/prefill", "external/reshard"} <= set(by_name)


def test_a_mesh_that_splits_a_torus_axis_is_built():
    """Catches make_mesh refusing a preset's mesh that needs a physical torus axis split: E7's
    v5p-64 mesh (data 8, fsdp 2, tensor 2) on v5p:4x4x2, which jax.make_mesh alone refuses
    (NotImplementedError), so the arm could not start on its slice; and a split that puts a
    tensor pair on chips that are not torus neighbours."""
    from ess_jax.memory import tpu
    from ess_jax.parallel import sharding as sharding_lib

    devices = tpu.topology_devices("v5p:4x4x2")
    mesh = sharding_lib.make_mesh({"data": 8, "fsdp": 2, "tensor": 2}, devices)
    assert dict(mesh.shape) == {"data": 8, "fsdp": 2, "tensor": 2, "expert": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    for pair in mesh.devices.reshape(16, 2):  # each tensor pair: one hop on the torus
        a, b = (np.array(d.coords) for d in pair)
        assert np.abs(a - b).sum() == 1, (a, b)


def test_token_microbatches_step_compiles_with_set_overrides(tiny, tmp_path, monkeypatch):
    """Catches --set overrides that the record does not keep (a --replan would then plan
    another config), and a token-budget step (train.pack_microbatches "tokens") built with
    the row micro-batches' count (4) or without its packed rows: its loop runs M times (M - 1
    from M = 3: P3O's statistics pass), M the count `programs.token_batch` derives (2 here:
    16 short sequences in 8 packed rows over 4 devices), and it sees fewer positions
    per micro-batch than the padded step (flops per loop body)."""
    from ess_jax.memory import programs, tpu
    from ess_jax.parallel import sharding as sharding_lib

    settings = ["objective.name='p3o'", "rollout.max_new_tokens=32", "train.num_microbatches=4"]
    out = {}
    for mode in ("rows", "tokens"):
        sets = settings + ([] if mode == "rows" else
                           ["train.pack_rows=True", "train.pack_microbatches=tokens"])  # fmt: skip
        path = tmp_path / f"{mode}.json"
        args = [f"--config={tiny}", "--topology=v5e:2x2", f"--json={path}", "--only=rl_step",
                "--in-process"]  # fmt: skip
        assert compile_tpu.main(args + [f"--set={x}" for x in sets]) == 0
        out[mode] = json.loads(path.read_text())
        assert out[mode]["set"] == sets
    config = compile_tpu.overridden(plan_memory.load_config(tiny), out["tokens"]["set"])
    mesh = sharding_lib.make_mesh(dict(config.mesh), tpu.topology_devices("v5e:2x2"))
    _, m = programs.token_batch(16, 16, 48, 0, mesh)
    step, padded = out["tokens"]["programs"]["rl_step"], out["rows"]["programs"]["rl_step"]
    assert m != 4 and step["loop_trips"] == (m - 1 if m > 2 else m) and "error" not in step
    assert step["flops"] < padded["flops"]
    monkeypatch.chdir(ROOT)
    assert compile_tpu.replan(out["tokens"]) == out["tokens"]


def test_a_refused_program_is_a_row_not_a_traceback(monkeypatch):
    """Catches a compiler refusal (a program larger than HBM) escaping as a traceback that
    loses the other programs' rows, and a record that says `fits` anyway."""
    import jax
    import jax.numpy as jnp

    from ess_jax.config.defaults import base_config
    from ess_jax.memory import programs, tpu

    real = programs.run_programs

    def with_a_huge_one(config, mesh):
        huge = jax.jit(lambda x: jnp.broadcast_to(x, (2**33,)) * 2.0)  # 32 GB of temporaries
        arg = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()))  # fmt: skip
        return [programs.Program("huge", huge, (arg,), 1.0)] + real(config, mesh)[:1]

    monkeypatch.setattr(programs, "run_programs", with_a_huge_one)
    c = base_config()
    c.model.num_layers, c.data.buckets, c.rollout.max_new_tokens = 1, (16,), 4
    c.data.prompts_per_step, c.rollout.group_size = 4, 2
    rows = tpu.compile_run(c, tpu.topology_devices("v5e:2x2"), log=lambda _: None)
    assert rows["huge"].compiler_bytes is None and "RESOURCE_EXHAUSTED" in rows["huge"].error
    assert rows["rl_step"].compiler_bytes > 0
    assert tpu.peak_bytes(rows) == rows["rl_step"].compiler_bytes + rows["rl_step"].beside_bytes


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config=configs/quickstart.py"], "no TPU preset after the arm"),
        (["--config=configs/nope.py:p3o,v5e-8"], "--config configs/nope.py:p3o,v5e-8: no such"),
        (["--config=configs/quickstart.py", "--topology=v9:2x2"], "topology 'v9:2x2'"),
        (
            ["--config=configs/quickstart.py", "--topology=v5e:2x2", "--only=rl_stp"],
            "no program ['rl_stp']",
        ),
        (
            ["--config=configs/quickstart.py", "--topology=v5e:2x2", "--set=train.nope=1"],
            "config has no field 'train.nope'",
        ),
        (
            ["--config=configs/paper/e3_temperature_1p2.py:p3o,v5p-8", "--topology=v5e:2x4"],
            "needs 4 devices, have 8 (--topology: give the mesh its device count",
        ),
    ],
)
def test_mistakes_are_one_line_exit_2(args, message, capsys, monkeypatch):
    """Catches a traceback for a config file that does not exist (FileNotFoundError from
    plan_memory.load_config), a config without a TPU preset, an unknown topology name, a
    misspelt --only program, or a preset's mesh on a --topology of another device count
    without the mend named."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        compile_tpu.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_v4_devices_are_megacore_chips_as_on_a_vm(capsys, monkeypatch):
    """Catches v4 described per TensorCore (libtpu's default chip config: 8 devices for
    v4:2x2x1, where a v4 VM shows its 4 megacore chips and the v4-8 preset and the planner
    count 4), and a preset whose topology libtpu describes with another device count let
    through instead of a one-line error."""
    from ess_jax.config import presets
    from ess_jax.memory import tpu

    assert tpu.device_count(tpu.topology_devices("v4:2x2x1")) == (4, 1)
    assert tpu.device_count(tpu.topology_devices("v4:2x2x2")) == (8, 2)
    assert tpu.device_count(tpu.topology_devices("v5p:2x2x1")) == (4, 1)  # v5p: already chips
    wrong = presets.Preset("v5e", 8, 1, {"data": 1, "fsdp": 8, "tensor": 1}, "v5e:2x2")
    monkeypatch.setitem(presets.PRESETS, "v5e-8", wrong)
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        compile_tpu.main(["--config=configs/paper/e2_qwen25_1p5b.py:p3o,v5e-8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert "topology v5e:2x2: libtpu describes 4 devices, the preset has 8" in err[0], err


def test_docs_table_is_the_committed_records():
    """Catches docs/tpu.md edited by hand or stale against results/tpu/*.json (regenerate:
    tools/compile_tpu.py --markdown --write=docs/tpu.md)."""
    doc = os.path.join(ROOT, "docs", "tpu.md")
    table = tpu_table.markdown_table(tpu_table.read_records())
    assert plan_memory.table_in(doc, tpu_table.BEGIN, tpu_table.END) == table


def test_a_layer_slice_is_planned_and_labelled_as_compiled(tmp_path):
    """The committed Qwen3-30B-A3B record compiled the model's first 4 layers (--layers 4):
    --replan plans the same slice (its committed planner bytes, not the whole 48-layer model's)
    and the docs table names the slice. Catches a replan or a table that reads a sliced record
    as the whole model (a planner error of several times the compiler's bytes)."""
    name = "moe_qwen3_30b_a3b__p3o+replay__v5p-64__rl_step__4_layers.json"
    rec = json.loads(open(os.path.join(ROOT, "results", "tpu", name)).read())
    assert rec["layers"] == 4
    path = tmp_path / name
    path.write_text(json.dumps(rec))
    assert compile_tpu.main(["--replan", str(path)]) == 0
    planned = json.loads(path.read_text())["programs"]["rl_step"]["planner_bytes"]
    assert planned == pytest.approx(rec["programs"]["rl_step"]["planner_bytes"], rel=1e-9)
    assert planned < 40e9  # the whole model plans several times more
    assert "(first 4 layers)" in tpu_table.markdown_table([rec])
