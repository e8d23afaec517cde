"""Config checks that need no jax: each field's value against the domain its record declares
(fields.RECORDS: a number's interval, a fixed-choice string's values, a bool, a string), required
fields, field names, the rules between fields, and the rollouts whose pi_b
objective.kl_estimator "full" cannot re-score exactly.

`check(config)` runs first in `experiment.validate`, and in `main` before jax is even imported,
so `--config.optim.lr=-0.5` fails in well under a second, before the workdir is touched, with
one line naming `config.optim.lr`. A typo'd field name, on the command line or inside a config
file, gets the closest valid one (or the field a name from another framework means, names.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import NoReturn

from ess_jax.config import names
from ess_jax.config.defaults import base_config
from ess_jax.config.domains import LORA_TARGETS, Domain
from ess_jax.config.fields import RECORDS
from ess_jax.config.names import as_dict, leaves, unknown_field

# The exit status of a mistake the user can fix, in `main` and the tools (argparse's too).
EXIT_USER_ERROR = 2


class UserError(Exception):
    """Something the user can fix: a config value, a busy workdir, an unreadable checkpoint.
    `main` reports it as one line (the traceback only with --verbose), the tools by
    `user_exit`."""


def error_line(msg, prefix: str = "error: ") -> str:
    """`msg` as the one line a command ends with: its whitespace and newlines collapsed."""
    return prefix + " ".join(str(msg).split())


class UserExit(SystemExit):
    """A SystemExit with status EXIT_USER_ERROR whose str() is its one line (a test matches
    it); `user_exit` prints the line before raising it."""

    def __init__(self, line: str):
        super().__init__(EXIT_USER_ERROR)
        self.line = line

    def __str__(self) -> str:
        return self.line


def user_exit(msg) -> NoReturn:
    """How a tool (tools/*.py, `python -m ess_jax.mismatch`) ends on a mistake the user can
    fix: `error_line(msg)` on stderr and exit status EXIT_USER_ERROR, as `main` ends on a
    UserError; raises UserExit, so an in-process caller (a test) can catch it."""
    line = error_line(msg)
    print(line, file=sys.stderr)
    raise UserExit(line)


class ConfigError(UserError, ValueError):
    """A config value or field name the user can fix; the message starts with `config.<path>`."""


def fail(path: str, msg: str):
    raise ConfigError(f"config.{path}: {msg}")


def check(config) -> None:
    """Every field is one of base_config's (`check_fields`), required fields are set, every
    field's value is in its record's domain (a number in its interval, a fixed-choice string one
    of its values), the rollout can be re-scored for objective.kl_estimator "full", and the
    rules between fields hold (`check_rules`); else ConfigError naming the first bad field."""
    check_fields(config)
    _check_values(config)
    check_full_kl(config)
    check_rules(config)


def check_fields(config) -> None:
    """Every field of `config` is a field of defaults.base_config (or a key of a free-form
    mapping, names.FREE_FORM): a typo inside a config file (`c.optim.lrr = 1`) would otherwise
    run with the default and land in config.json. Only extra fields are refused (a partial
    config passes)."""
    for path, _ in leaves(as_dict(config)):
        if not names.is_known(path):
            msg = unknown_field(base_config(), path)
            raise ConfigError(msg or f"config.{path}: no such field")


def check_rules(config) -> None:
    """Rules between fields that need no devices, files or task (those are experiment.validate's:
    the mesh's data ranks, checkpoint paths, the task's own dials). A rule whose fields a partial
    config lacks is skipped."""
    c = as_dict(config)

    def get(*paths):
        values = [names.lookup(c, p) for p in paths]
        return None if any(v is names.MISSING for v in values) else values

    if v := get("model.source", "model.num_heads", "model.num_kv_heads"):
        source, heads, kv_heads = v
        if source == "embedded" and heads % kv_heads:
            fail("model.num_kv_heads", f"{kv_heads} does not divide num_heads={heads}")
    if v := get("model.source", "model.num_experts", "model.num_experts_per_tok"):
        source, experts, top_k = v
        if source == "embedded" and experts and top_k > experts:
            fail("model.num_experts_per_tok", f"{top_k} is more than num_experts={experts}")
    if (v := get("model.attention_impl", "model.dtype")) and v[0] == "cudnn" and v[1] != "bfloat16":
        fail("model.attention_impl", f"'cudnn' needs model.dtype 'bfloat16', got {v[1]!r}")
    if v and v[0] == "splash" and v[1] not in ("float32", "bfloat16"):
        fail("model.attention_impl", f"'splash' needs model.dtype float32 / bfloat16, not {v[1]!r}")
    _check_lora(get)
    if v := get("rollout.max_resample_rounds", "rollout.dynamic_sampling", "rollout.group_size"):
        rounds, dynamic, group = v
        if rounds and not dynamic:
            fail("rollout.max_resample_rounds", "resampling needs rollout.dynamic_sampling=True")
        if rounds and group < 2:
            fail(
                "rollout.max_resample_rounds",
                f"every group of rollout.group_size={group} has a constant reward: "
                "resampling could never fill the batch",
            )
    _check_learnable(get)
    _check_async(get)
    _check_roles(get)
    _check_packing(get)
    if v := get("rollout.external_fraction", "rollout.external_checkpoint", "rollout.group_size"):
        fraction, checkpoint, group = v
        if fraction > 0 and not checkpoint:
            fail("rollout.external_checkpoint", "needed when rollout.external_fraction > 0")
        if fraction > 0 and round(fraction * group) in (0, group):
            fail(
                "rollout.external_fraction",
                f"{fraction} of a group of {group} rounds to no or all samples",
            )
    paths = ("data.prompts_per_step", "rollout.group_size", "train.updates_per_batch")
    if v := get(*paths, "train.num_microbatches", "rollout.sample_microbatches"):
        prompts, group, updates, micro, sample_micro = v
        batch = prompts * group
        if batch % updates:
            fail(
                "train.updates_per_batch",
                f"rollout batch {batch} (data.prompts_per_step x "
                f"rollout.group_size) is not divisible by it",
            )
        if prompts % sample_micro:
            fail("rollout.sample_microbatches", "does not divide data.prompts_per_step")
        if (batch // updates) % micro:
            fail(
                "train.num_microbatches", f"update batch {batch // updates} is not divisible by it"
            )


def _check_learnable(get) -> None:
    """Refuse the RL runs whose every advantage is 0 by construction: every advantage_mode
    (grpo, drgrpo, rloo) centres a reward on its group's mean, so a group of one sample, or of
    greedy samples (one completion drawn G times, one reward), gives no policy gradient; only
    the KL and entropy terms would move the policy. An external model's samples differ from the
    policy's, so greedy groups that mix both can still learn."""
    v = get("train.steps", "rollout.group_size", "rollout.temperature", "rollout.external_fraction")
    if not v or not v[0]:
        return  # no RL steps (an SFT warm start)
    _, group, temperature, external = v
    if group == 1:
        fail(
            "rollout.group_size",
            "1: each reward is its group's mean, so every group-relative advantage is 0 and RL "
            "cannot learn; use >= 2 samples per prompt",
        )
    if temperature == 0 and not external:
        fail(
            "rollout.temperature",
            f"0 (greedy) draws one completion rollout.group_size={group} times per prompt: each "
            "group's rewards are equal, every advantage is 0 and RL cannot learn; use a "
            "temperature > 0 (eval.temperature=0 evaluates greedily)",
        )


def _check_async(get) -> None:
    """train.mode "async" (ess_jax/rl/actor_learner.py): the sampler waits for a params push
    when its next batch would be more than the lag budget behind, and pushes come every
    train.sync_every steps, so a budget under sync_every - 1 would wait forever. The sync
    loop's simulated lag and the "full" KL (pi_b's params per version) are refused with it."""
    v = get("train.mode", "rollout.max_lag", "train.sync_every", "rollout.lag")
    if not v or v[0] != "async":
        return
    _, max_lag, every, lag = v
    if max_lag < every - 1:
        fail(
            "rollout.max_lag",
            f"{max_lag} < train.sync_every - 1 = {every - 1}: with params pushed every {every} "
            "steps the sampler would wait forever; raise max_lag or lower sync_every",
        )
    if lag:
        fail("rollout.lag", "train.mode 'async' has real staleness: bound it with rollout.max_lag")
    if (v := get("objective.kl_estimator")) and v[0] == "full":
        fail(
            "objective.kl_estimator",
            "'full' re-scores pi_b from its params, which train.mode 'async' does not keep per "
            "version: use k1/k2/k3",
        )


def _check_roles(get) -> None:
    """train.async_role trainer / sampler (ess_jax/rl/groups.py): one group of a train.mode
    "async" run in two programs, which meet at train.async_address (host:port)."""
    v = get("train.async_role", "train.async_address", "train.mode")
    if not v or v[0] == "both":
        return
    role, address, mode = v
    if mode != "async":
        fail("train.async_role", f"{role!r} is one group of train.mode 'async', not {mode!r}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(
            "train.async_address",
            f"{address!r} is not host:port (the trainer group's, where the sampler connects)",
        )


def _check_packing(get) -> None:
    """train.pack_rows (ess_jax/rl/packed.py) packs the trainer's forwards; things that read the
    padded rows per position cannot be packed exactly: pi_b's full-vocabulary re-score,
    LoRA dropout's masks (drawn per padded row and position) and a recorded MoE routing; nor
    does the packed forward compute the router's load-balancing loss. Micro-batches by tokens
    (train.pack_microbatches) choose which sequences share a micro-batch: only the "step" ESS
    scope is blind to that, and vcpo's batch pass reads the rows in their groups."""
    by_tokens = (v := get("train.pack_microbatches")) and v[0] == "tokens"
    if not (v := get("train.pack_rows")) or not v[0]:
        if by_tokens:
            fail("train.pack_microbatches", "'tokens' cuts packed rows: set train.pack_rows=True")
        return
    if by_tokens and (v := get("objective.ess_scope")) and v[0] != "step":
        fail(
            "train.pack_microbatches",
            f"'tokens' decides which sequences share a micro-batch, which objective.ess_scope="
            f"{v[0]!r} reads (its ESS per micro-batch): use ess_scope 'step' or 'rows'",
        )
    if by_tokens and (v := get("objective.name")) and v[0] == "vcpo":
        fail(
            "train.pack_microbatches",
            "'tokens' regroups the rows, and vcpo's batch pass reads them in groups of "
            "rollout.group_size: use 'rows'",
        )
    if (v := get("objective.kl_estimator")) and v[0] == "full":
        fail(
            "train.pack_rows",
            "objective.kl_estimator='full' re-scores pi_b on the padded rows: use k1/k2/k3 or "
            "train.pack_rows=False",
        )
    if (v := get("model.lora.dropout")) and v[0] > 0:
        fail(
            "train.pack_rows",
            "model.lora.dropout draws its masks per padded row and position: set it to 0 or "
            "train.pack_rows=False",
        )
    if (v := get("model.routing_replay")) and v[0] != "none":
        fail(
            "train.pack_rows",
            "model.routing_replay replays routing recorded per padded row and position: set "
            "it to 'none' or train.pack_rows=False",
        )
    if (v := get("model.moe_aux_loss_coef")) and v[0] > 0:
        fail(
            "train.pack_rows",
            "the packed forward does not compute model.moe_aux_loss_coef's router loss: set "
            "it to 0 or train.pack_rows=False",
        )


def check_full_kl(config) -> None:
    """objective.kl_estimator "full" re-scores pi_b's whole distribution in the train step
    (ess_jax/sampling/rescore.py). Refuse what cannot be re-scored exactly instead of
    approximating it."""
    c = as_dict(config)
    objective = c.get("objective", {})
    if objective.get("kl_estimator") != "full" or objective.get("name") != "p3o":
        return  # other objectives: ObjectiveConfig refuses "full" (they have no use for it)
    r, why = c.get("rollout", {}), "cannot be re-scored exactly for objective.kl_estimator='full'"
    lowp = (
        "the sampler's low-precision decode rounds differently from any full-sequence forward "
        "(log-probs ~1e-2 apart, as large as the precision mismatch itself)"
    )
    if r.get("precision", "float32") != "float32":
        fail("rollout.precision", f"{r['precision']!r} {why}: {lowp}; use float32 or k1/k2/k3")
    if r.get("kv_cache_precision", "compute") != "compute":
        fail(
            "rollout.kv_cache_precision",
            f"{r['kv_cache_precision']!r} {why}: the decode reads keys and values rounded to it, "
            "a full-sequence forward does not; use compute or k1/k2/k3",
        )
    if r.get("external_fraction", 0) > 0 and r.get("external_precision", "float32") != "float32":
        fail(
            "rollout.external_precision",
            f"{r['external_precision']!r} {why}: {lowp}; use float32 or k1/k2/k3",
        )
    if r.get("temperature", 1.0) == 0:
        fail("rollout.temperature", f"0 (greedy) {why}: pi_b is a point mass, the KL is infinite")
    if c.get("model", {}).get("logits_chunk", 0) <= 0:
        fail(
            "model.logits_chunk",
            "objective.kl_estimator='full' needs it > 0: the policy's and pi_b's logits are "
            "held for logits_chunk positions at a time, never [B, T, V] twice (e.g. 256)",
        )


def _check_values(config) -> None:
    """Each value against its field's record (fields.RECORDS): None only where the domain is
    optional; a sequence of numbers (data.buckets) element by element. Keys inside a free-form
    mapping (task.difficulty) have no record: the task checks them."""
    for path, value in leaves(as_dict(config)):
        record = RECORDS.get(path)
        if value is None:
            if record is None or not record.domain.optional:
                fail(path, f"required and not set: give it, e.g. --config.{path}=...")
            continue
        if record is None:
            continue
        domain = record.domain
        sequence = isinstance(domain, Domain) and isinstance(value, (list, tuple))
        for v in value if sequence else (value,):
            if not domain.contains(v):
                fail(path, f"must be {domain.describe()}, got {value!r}")


def lora_targets(value) -> tuple[str, ...]:
    """model.lora.targets ("q,v", or a sequence of names) as a tuple of names."""
    items = value.split(",") if isinstance(value, str) else value
    return tuple(str(t).strip() for t in items if str(t).strip())


def _check_lora(get) -> None:
    if v := get("model.lora.targets"):
        targets = lora_targets(v[0])
        bad = [t for t in targets if t not in LORA_TARGETS]
        if bad or not targets:
            fail("model.lora.targets", f"{bad or 'empty'}: a subset of {', '.join(LORA_TARGETS)}")
    if (v := get("model.lora.base_precision", "model.lora.rank")) and v[0] != "compute":
        if not v[1]:
            fail(
                "model.lora.base_precision",
                f"{v[0]!r} quantizes LoRA's frozen base: needs rank > 0",
            )
    if (v := get("model.lora.dropout", "model.lora.rank")) and v[0] and not v[1]:
        fail("model.lora.dropout", f"{v[0]} drops the adapters' inputs: needs rank > 0")


def check_names(config, paths: Iterable[str], what: str) -> None:
    """Each of `paths` (a field, a section, or `section.*`) exists in `config`."""
    for p in paths:
        msg = unknown_field(config, p.removesuffix(".*"))
        if msg:
            raise ConfigError(f"{what}: {msg}")
