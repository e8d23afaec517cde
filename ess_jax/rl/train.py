"""The RL run: `Run` and `run`, the entry point of `ess_jax.main`.

`Run` is the composition root and the outer loop; each of its parts answers for one thing:

    Run                 builds the parts from the config; checkpoints (save, restore, Ctrl-C);
                        the phases (SFT warm start, eval, HF export); the step loop and its rows
      Trainer           the train state, policy history, reference params and data position;
                        `learn` trains on one batch (rl/trainer.py, through `update.Learner`)
      Collector         draws batch k: prompts, engine, rewards, the step key (rl/collect.py)
      SyncLoop /        one step: draw then train, or take the sampler thread's batch then
      ActorLearner      train (train.mode; rl/actor_learner.py)

The loops see the trainer and the collector only, never `Run`.
"""

from __future__ import annotations

import logging
import os
import shutil

import jax
from tqdm import tqdm

from ess_jax import objectives as obj_lib
from ess_jax import rewards as rewards_lib
from ess_jax.io import workdir as workdir_lib
from ess_jax.io.checkpoint import Checkpointer
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import (
    actor_learner,
    device_split,
    experiment,
    groups,
    lora_policy,
    packed,
    preemption,
    steps,
)
from ess_jax.rl import heldout as eval_lib
from ess_jax.rl import rollout as rollout_lib
from ess_jax.rl import sft as sft_lib
from ess_jax.rl import update as update_lib
from ess_jax.rl.collect import Collector
from ess_jax.rl.full_kl import FullKL
from ess_jax.rl.health import HealthWatch, report
from ess_jax.rl.metrics import MetricsWriter, eval_summary, plot_run, progress_postfix
from ess_jax.rl.optim import learning_rate_schedule, make_optimizer
from ess_jax.rl.trainer import NonFiniteError, Trainer
from ess_jax.sampling.engine import RolloutEngine

__all__ = ["NonFiniteError", "Run", "run"]


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
        self.rollout_cfg = experiment.rollout_config(config, self.stop_ids)
        self.train_examples, test = experiment.load_examples(config.task)
        # every prompt tokenized and checked against data.buckets before any work
        batcher = experiment.train_batcher(config, self.train_examples, self.tokenizer)
        self.test_examples = experiment.heldout_examples(config, test, self.tokenizer)
        self.reward_fn = rewards_lib.get_reward(config.task.reward)
        self.sample_sh = model_lib.param_shardings(self.model_cfg, self.mesh, "sample")
        self.objective_cfg = obj_lib.objective_config(config.objective.to_dict())
        optim_cfg = {
            **config.optim.to_dict(),
            "total_steps": config.train.steps * config.train.updates_per_batch,
        }
        tx = make_optimizer(optim_cfg)
        state, state_sh = steps.init_state(params, tx, self.mesh, frozen)
        history = rollout_lib.ParamHistory(config.rollout.lag)
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
            tx,
            t.num_microbatches,
            config.seed,
            int(self.rollout_cfg.group_size),
            t.pack_length if t.pack_rows else None,
            packed.by_tokens(config),
        )
        full = FullKL.for_run(  # None unless objective.kl_estimator "full"
            self.objective_cfg,
            self.rollout_cfg,
            history.lag,
            t.updates_per_batch,
            self.external,
        )
        learner = update_lib.Learner(
            ucfg, self.mesh, state_sh, t.updates_per_batch, full, self.external
        )
        self.trainer = Trainer(
            state,
            state_sh,
            learner,
            history,
            batcher,
            learning_rate_schedule(optim_cfg),
            self.objective_cfg.beta_kl,
        )
        self.rng = jax.random.key(config.seed)

    def collector(self) -> Collector:
        """How the loops draw a batch (rl/collect.py), from this run's tokenizer, reward
        function, rollout config and key."""
        return Collector(self.tokenizer, self.reward_fn, self.rollout_cfg, self.rng)

    def loop(self):
        """What `_run` calls each step, by train.mode: `SyncLoop`, or `ActorLearner` (a sampler
        thread on the rollout mesh)."""
        if self.config.train.mode != "async":
            return self._sync_loop()
        if self.config.train.async_role == "trainer":  # the sampler group: another program
            link = groups.RemoteLink(self.trainer, self.config, self.model_cfg)
        else:
            link = actor_learner.LocalLink(
                self.trainer,
                self.collector(),
                self.model_cfg,
                self.rollout_mesh,
                self.engine,
                self.external,
                self.config.rollout.max_lag,
            )
        return actor_learner.ActorLearner(
            self.trainer, link, self.pacer, self.config.train.sync_every
        )

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, force: bool = False) -> None:
        meta = {
            "step": step,
            **self.trainer.checkpoint_meta(),
            **({"pacing": self.pacer.state()} if self.pacer else {}),
            "config": self.config.to_dict(),
        }
        self.ckpt.save(step, self.trainer.checkpoint_tree(), meta, force=force)

    def try_restore(self) -> int | None:
        found = self.ckpt.restore_newest_intact(
            lambda meta: self.trainer.abstract_tree(len(meta["history_versions"])),
            fallback=self.config.train.restore_fallback,
        )
        if found is None:
            return None
        step, tree, meta = found
        self.trainer.restore(tree, meta)
        if self.pacer and "pacing" in meta:
            self.pacer.restore(meta["pacing"])
        return step

    # ------------------------------------------------------------------ phases
    def sft(self) -> None:
        """The SFT warm start (`sft.warm_start`; nothing with sft.steps 0)."""
        self.trainer.state = sft_lib.warm_start(
            self.config,
            self.model_cfg,
            self.trainer.state,
            self.mesh,
            self.train_examples,
            self.tokenizer,
            quiet=_secondary(),
        )

    def evaluate(self, step: int) -> dict:
        e = self.config.eval  # the eval's own engine, in eval.precision; dropped on return
        formats = (str(e.get("precision", "float32")), str(e.get("kv_cache_precision", "compute")))
        engine = lora_policy.engine(self.model_cfg, *formats)
        state = self.trainer.state
        engine.update_params(step, lora.join(state.frozen, state.params))
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
        if self.trainer.state.frozen is None:
            weights.save_hf(
                self.model_cfg, self.trainer.state.params, tmp, tokenizer=self.tokenizer
            )
        else:  # model.lora: the merged model here, the adapter alone in <workdir>/peft
            peft = os.path.join(self.workdir, "peft")
            s, src = self.trainer.state, self.config.model.source
            lora_policy.export(self.model_cfg, s.frozen, s.params, tmp, peft, self.tokenizer, src)
        if jax.process_index() == 0:
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
        return path

    def save_on_interrupt(self, step: int) -> None:
        """Ctrl-C or SIGTERM: save what can be saved without losing or corrupting anything
        (`Trainer.interrupted_step` says which step's state that is)."""
        at = self.trainer.interrupted_step(step)
        if at is None:
            logging.error(
                "interrupted inside an update: keeping the checkpoint at step %s",
                self.ckpt.latest_step(),
            )
            return
        logging.warning("interrupted: saving a checkpoint at step %d", at)
        self.save(at, force=True)

    def rl_step(self, step: int) -> dict:
        """One synchronous step (draw, then train), whatever train.mode says: its row."""
        return self._sync_loop().step(step)

    def _sync_loop(self) -> actor_learner.SyncLoop:
        return actor_learner.SyncLoop(self.trainer, self.collector(), self.engine, self.external)

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
            self.trainer.keep_reference()
            start = 0
        history = self.trainer.history
        if not history.state():
            history.push(0, self.trainer.state.params)
            self.save(0, force=True)  # the SFT warm start is never redone after a crash
        step, health = start, HealthWatch(self.model_cfg.vocab_size)
        left = range(start, t.steps)
        bar = tqdm(left, "rl", t.steps, initial=start, dynamic_ncols=True, disable=_secondary())
        loop = self.loop()  # train.mode: sync, or async (a sampler thread)
        failure = None  # what ended the loop, if it failed (a Ctrl-C or SIGTERM is a stop)
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
        except BaseException as e:
            failure = e
            raise
        finally:
            loop.stop(failure)  # the sampler, if any (it reads none of what a save writes)
            self.ckpt.wait()
            writer.close()
        if _secondary():
            return os.path.join(self.workdir, "curves.png")  # process 0 writes it
        return plot_run(self.workdir)


def _secondary() -> bool:
    """A process other than the first of a multi-host run: it writes no files, shows no bars."""
    return jax.process_index() != 0


def run(config, workdir: str, allow_config_change=()) -> str:
    """Runs SFT warm start (if configured) then RL; returns the path of the curves PNG.

    Resuming a workdir with a config that differs from its checkpoint's outside
    `workdir.SAFE_ON_RESUME` needs the changed fields (or sections) in `allow_config_change`."""
    return Run(config, workdir, allow_config_change).run()
