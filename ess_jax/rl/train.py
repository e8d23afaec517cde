"""The RL loop: `Run` (build, SFT warm-up, rollout -> reward -> advantages -> updates, eval,
checkpoints, export) and `run`, the entry point of `ess_jax.main`. The updates on a rollout
batch are `ess_jax.rl.update`'s `Learner`, the SFT warm-up is `ess_jax.rl.sft`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

from ess_jax import objectives as obj_lib
from ess_jax import rewards as rewards_lib
from ess_jax.config.schema import UserError
from ess_jax.io import workdir as workdir_lib
from ess_jax.io.checkpoint import Checkpointer
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import (
    actor_learner,
    device_split,
    dynamic_sampling,
    experiment,
    lora_policy,
    preemption,
    steps,
)
from ess_jax.rl import heldout as eval_lib
from ess_jax.rl import rollout as rollout_lib
from ess_jax.rl import sft as sft_lib
from ess_jax.rl import update as update_lib
from ess_jax.rl.full_kl import FullKL
from ess_jax.rl.health import HealthWatch, report
from ess_jax.rl.metrics import MetricsWriter, eval_summary, plot_run, progress_postfix
from ess_jax.rl.optim import learning_rate_schedule, make_optimizer
from ess_jax.sampling.engine import RolloutEngine

MAX_NONFINITE_IN_A_ROW = 3


class NonFiniteError(UserError, RuntimeError): ...


class Run:
    """Everything one RL run holds; `run(config, workdir)` drives it. It holds the workdir's
    lock from construction to the end of `run()` (or `close()`). `engine`: the
    `RolloutEngine` that draws the policy's rows in both loops (docs/rollout_engines.md);
    None: the in-JAX sampler (`rollout.policy_engine`)."""

    def __init__(self, config, workdir: str, allow_config_change=(), engine=None):
        sharding_lib.maybe_initialize_distributed()  # before validate: it counts devices
        experiment.validate(config)
        self.config, self.workdir = config, os.path.abspath(workdir)
        self.engine: RolloutEngine | None = engine
        self.ckpt = Checkpointer(
            os.path.join(self.workdir, "checkpoints"), keep=config.train.keep_checkpoints
        )
        self._lock = workdir_lib.claim(
            self.workdir,
            config,
            self.ckpt,
            allow_config_change,
            primary=jax.process_index() == 0,
            num_processes=jax.process_count(),
        )
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the workdir."""
        if self._lock is not None:
            self._lock.release()

    def _build(self, config) -> None:
        self.mesh, self.rollout_mesh = device_split.meshes(config)  # rollout: async only
        self.model_cfg, params, self.tokenizer = experiment.load_policy(config.model, self.mesh)
        # model.lora: params become the adapters, the loaded weights the frozen base
        self.model_cfg, frozen, params = lora_policy.attach(
            config.model, self.model_cfg, params, self.mesh, config.seed
        )
        self.stop_ids = experiment.stop_ids(config, self.tokenizer)
        self.rollout_cfg = _with_stop_ids(config.rollout, self.stop_ids)
        self.train_examples, test = experiment.load_examples(config.task)
        # every prompt tokenized and checked against data.buckets before any work
        self.batcher = experiment.train_batcher(config, self.train_examples, self.tokenizer)
        self.test_examples = experiment.heldout_examples(config, test, self.tokenizer)
        self.reward_fn = rewards_lib.get_reward(config.task.reward)
        self.sample_sh = model_lib.param_shardings(self.model_cfg, self.mesh, "sample")
        self.objective_cfg = obj_lib.objective_config(config.objective.to_dict())
        optim_cfg = {
            **config.optim.to_dict(),
            "total_steps": config.train.steps * config.train.updates_per_batch,
        }
        self.tx = make_optimizer(optim_cfg)
        self.lr_schedule = learning_rate_schedule(optim_cfg)
        self.state, self.state_sh = steps.init_state(params, self.tx, self.mesh, frozen)
        self.history = rollout_lib.ParamHistory(config.rollout.lag)
        self.pacer = actor_learner.make_pacer(config)  # async: ESS pacing, kept in checkpoints
        if self.engine is None and self.rollout_mesh is None:  # async: on the rollout mesh
            self.engine = rollout_lib.policy_engine(self.model_cfg, self.rollout_cfg)
        self.external = None
        if config.rollout.external_fraction > 0:
            ecfg, eparams, _ = experiment.load_policy(
                experiment.with_source(config.model, config.rollout.external_checkpoint),
                self.mesh,
                need_tokenizer=False,
            )
            if ecfg.vocab_size != self.model_cfg.vocab_size:
                experiment.fail(
                    "rollout.external_checkpoint",
                    f"vocab size {ecfg.vocab_size} != policy's {self.model_cfg.vocab_size}",
                )
            # kept in the train layout (FSDP-sharded); gathered only while it samples
            self.external = rollout_lib.external_engine(ecfg, eparams, self.rollout_cfg)
        t = config.train
        ucfg = update_lib.UpdateConfig(
            self.model_cfg,
            self.objective_cfg,
            self.tx,
            t.num_microbatches,
            config.seed,
            int(self.rollout_cfg.group_size),
        )
        full = FullKL.for_run(  # None unless objective.kl_estimator "full"
            self.objective_cfg,
            self.rollout_cfg,
            self.history.lag,
            t.updates_per_batch,
            self.external,
        )
        self.learner = update_lib.Learner(
            ucfg, self.mesh, self.state_sh, t.updates_per_batch, full, self.external
        )
        self.ref_params = None
        self.rng = jax.random.key(config.seed)
        self.step_start = None  # (data position, optimizer step) while a step runs

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_tree(self):
        return {
            "state": self.state.replace(frozen=None),  # model.lora: the base is model.source
            "history": [p for _, p in self.history.state()],
            **({"ref": self.ref_params} if self.ref_params is not None else {}),
        }

    def save(self, step: int, force: bool = False) -> None:
        meta = {
            "step": step,
            "data": self.batcher.state(),
            "history_versions": [v for v, _ in self.history.state()],
            **({"pacing": self.pacer.state()} if self.pacer else {}),
            "config": self.config.to_dict(),
        }
        self.ckpt.save(step, self._ckpt_tree(), meta, force=force)

    def try_restore(self) -> int | None:
        found = self.ckpt.restore_newest_intact(
            lambda meta: self._abstract_tree(len(meta["history_versions"])),
            fallback=self.config.train.restore_fallback,
        )
        if found is None:
            return None
        step, tree, meta = found
        self.state = tree["state"].replace(frozen=self.state.frozen)
        self.ref_params = tree.get("ref")
        self.history.restore(list(zip(meta["history_versions"], tree["history"])))
        self.batcher.restore(meta["data"])
        if self.pacer and "pacing" in meta:
            self.pacer.restore(meta["pacing"])
        return step

    def _abstract_tree(self, n_history: int):
        as_abstract = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        unfrozen = self.state.replace(frozen=None), self.state_sh.replace(frozen=None)
        state = jax.tree.map(as_abstract, *unfrozen)
        hist_one = jax.tree.map(as_abstract, self.state.params, self.state_sh.params)
        tree = {"state": state, "history": [hist_one] * n_history}
        if self.objective_cfg.beta_kl > 0:
            tree["ref"] = jax.tree.map(as_abstract, self.state.params, self.state_sh.params)
        return tree

    # ------------------------------------------------------------------ phases
    def sft(self) -> None:
        """The SFT warm start (`sft.warm_start`; nothing with sft.steps 0)."""
        self.state = sft_lib.warm_start(
            self.config,
            self.model_cfg,
            self.state,
            self.mesh,
            self.train_examples,
            self.tokenizer,
            quiet=_secondary(),
        )

    def evaluate(self, step: int) -> dict:
        e = self.config.eval  # the eval's own engine, in eval.precision; dropped on return
        formats = (str(e.get("precision", "float32")), str(e.get("kv_cache_precision", "compute")))
        engine = lora_policy.engine(self.model_cfg, *formats)
        engine.update_params(step, lora.join(self.state.frozen, self.state.params))
        rng = jax.random.fold_in(jax.random.fold_in(self.rng, 2), step)
        return eval_lib.evaluate(
            engine,
            self.test_examples,
            self.tokenizer,
            self.reward_fn,
            e,
            self.stop_ids,
            rng,
            buckets=tuple(self.config.data.buckets),
        )

    def export_hf(self) -> str:
        """The current params and tokenizer as a Hugging Face checkpoint in <workdir>/hf (with
        model.lora: merged, and the PEFT adapter in <workdir>/peft), written to a temporary
        directory first so a reader never sees a half-written one."""
        from ess_jax.io import weights

        path = os.path.join(self.workdir, "hf")
        tmp = path + ".tmp"
        if jax.process_index() == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp)
        if self.state.frozen is None:
            weights.save_hf(self.model_cfg, self.state.params, tmp, tokenizer=self.tokenizer)
        else:  # model.lora: the merged model here, the adapter alone in <workdir>/peft
            peft = os.path.join(self.workdir, "peft")
            s, src = self.state, self.config.model.source
            lora_policy.export(self.model_cfg, s.frozen, s.params, tmp, peft, self.tokenizer, src)
        if jax.process_index() == 0:
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
        return path

    def save_on_interrupt(self, step: int) -> None:
        """Ctrl-C or SIGTERM: save what can be saved without losing or corrupting anything.

        Between steps the state is the newest policy version's. Before the step's first update
        (sampling takes most of a step) it is the step's start state: rewind the data iterator
        and the resume is exact. After it, the update has donated buffers the policy history
        may share (lag 0, same layouts): save the updated state as step + 1 (that step's row is
        not written). During it, the old state is gone: keep the last periodic checkpoint."""
        started = self.step_start
        leaves = jax.tree.leaves(self.state)
        if any(x.is_deleted() for x in leaves):
            logging.error(
                "interrupted inside an update: keeping the checkpoint at step %s",
                self.ckpt.latest_step(),
            )
            return
        if started is None:
            step = self.history.state()[-1][0]
        elif int(self.state.step) != started[1]:
            step += 1
            self.history.push(step, jax.tree.map(jnp.copy, self.state.params))
        else:
            self.batcher.restore(started[0])
        logging.warning("interrupted: saving a checkpoint at step %d", step)
        self.save(step, force=True)

    def rl_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        self.step_start = (self.batcher.state(), int(self.state.step))
        version, params_b = self.history.behaviour()
        rng = jax.random.fold_in(jax.random.fold_in(self.rng, 1), step)
        self.engine.update_params(version, lora.join(self.state.frozen, params_b))
        with preemption.interruptible():  # a signal: the step is redone from its start state
            try:
                rollout, metrics = dynamic_sampling.collect_batch(
                    self.engine,
                    self.batcher,
                    self.tokenizer,
                    self.reward_fn,
                    self.rollout_cfg,
                    rng,
                    external=self.external,
                )
            finally:
                self.engine.release()
        return self.learn(step, rollout, metrics, version, params_b, t0)

    def learn(self, step, rollout, metrics, version, params_b, t0) -> dict:
        """Updates on a rollout drawn by policy `version` (params `params_b`); the row."""
        t_sample = time.perf_counter() - t0
        self.state, row = self.learner.learn(
            self.state, rollout, params_b, self.ref_params, on_update=self._hold
        )
        if int(self.state.nonfinite) >= MAX_NONFINITE_IN_A_ROW:
            raise NonFiniteError(
                f"{int(self.state.nonfinite)} updates in a row had a non-finite loss or gradient "
                f"(step {step}); the last good state is kept. Lower optim.lr or check the data."
            )
        # train layout (FSDP-sharded): the sampler gathers a version only while it samples
        self.history.push(step + 1, self.state.params)
        self.step_start = None
        elapsed = time.perf_counter() - t0
        row.update(metrics)
        row.update(
            step=step,
            policy_lag=step - version,
            lr=float(self.lr_schedule(int(self.state.step))),
            tokens_per_s=float(rollout.loss_mask.sum()) / elapsed,
            sample_s=t_sample,
            step_s=elapsed,
        )
        return row

    def _hold(self, state) -> None:
        """The newest state, after each update of a batch (`save_on_interrupt` reads it)."""
        self.state = state

    def _eval(self, writer, step: int) -> None:
        with preemption.interruptible():
            row = {"step": step, **self.evaluate(step)}
        writer.write(row)
        if writer.active:
            tqdm.write(eval_summary(row))

    def run(self) -> str:
        try:
            with preemption.on_stop_signals(), workdir_lib.write_errors(self.workdir):
                return self._run()
        finally:
            self.close()

    def _run(self) -> str:
        t = self.config.train
        start = self.try_restore()
        workdir_lib.check_not_past(self.workdir, start, t.steps)
        if jax.process_index() == 0:
            workdir_lib.write_config(self.workdir, self.config)
        # process 0 writes the shared workdir's files; the other processes' rows are the same
        writer = MetricsWriter(
            self.workdir, resume_step=start if start is not None else 0, active=not _secondary()
        )
        if start is None:
            self.sft()
            if self.objective_cfg.beta_kl > 0:
                self.ref_params = jax.tree.map(jnp.copy, self.state.params)
            start = 0
        if not self.history.state():
            self.history.push(0, self.state.params)
            self.save(0, force=True)  # the SFT warm start is never redone after a crash
        step, health = start, HealthWatch(self.model_cfg.vocab_size)
        left = range(start, t.steps)
        bar = tqdm(left, "rl", t.steps, initial=start, dynamic_ncols=True, disable=_secondary())
        loop = actor_learner.loop_for(self)  # train.mode: sync, or async (a sampler thread)
        try:
            loop.start(start)
            for step in bar:
                if self.config.eval.every and step % self.config.eval.every == 0:
                    self._eval(writer, step)
                row = loop.step(step)
                writer.write(row)
                report(health.update(row))
                bar.set_postfix_str(progress_postfix(row))
                if (step + 1) % t.checkpoint_every == 0:
                    self.save(step + 1)
                preemption.check()  # a SIGTERM or Ctrl-C held during the step stops here
            step = t.steps
            if self.config.eval.every:
                self._eval(writer, step)
            self.save(step, force=True)
            if t.export_hf:
                self.export_hf()
        except KeyboardInterrupt:
            self.save_on_interrupt(step)
            raise
        finally:
            loop.stop()  # the sampler thread, if any (it reads none of what a save writes)
            self.ckpt.wait()
            writer.close()
        if _secondary():
            return os.path.join(self.workdir, "curves.png")  # process 0 writes it
        return plot_run(self.workdir)


def _secondary() -> bool:
    """A process other than the first of a multi-host run: it writes no files, shows no bars."""
    return jax.process_index() != 0


def _with_stop_ids(rcfg, ids):
    r = rcfg.copy_and_resolve_references()
    r.stop_ids = tuple(int(i) for i in ids)
    return r


def run(config, workdir: str, allow_config_change=()) -> str:
    """Runs SFT warm start (if configured) then RL; returns the path of the curves PNG.

    Resuming a workdir with a config that differs from its checkpoint's outside
    `workdir.SAFE_ON_RESUME` needs the changed fields (or sections) in `allow_config_change`."""
    return Run(config, workdir, allow_config_change).run()
