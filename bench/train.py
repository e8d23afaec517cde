"""Part of bench/cpu.py: the machine's float32 matmul ceiling, and one training step
(forward + backward + AdamW, the P3O objective) of ess_jax against a PyTorch loop over the
same Hugging Face LlamaForCausalLM and weights, eager and under torch.compile.

Both sides do the same work on the same batch: teacher-forced log-probs of every token
(float32 [B, T, V] logits, log-softmax, gather), the P3O loss with its defaults (token mean,
k3 KL, the ESS over the whole batch), its gradient, and AdamW with the same hyper-parameters
and no clipping. `first_loss` records each side's loss on the shared starting weights.
"""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import Sizes, median, time_round_robin, train_flops
from ess_jax.model import scoring
from ess_jax.objectives import ObjectiveConfig
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import steps
from ess_jax.rl import update as update_lib
from ess_jax.rl.advantages import broadcast_to_tokens, group_advantages
from ess_jax.rl.optim import make_optimizer

# Both sides' AdamW (betas 0.9 / 0.999, eps 1e-8: both libraries' defaults).
OPTIM = {"lr": 1e-5, "weight_decay": 0.01, "max_grad_norm": 0.0, "schedule": "constant"}


def gemm_ceiling(s: Sizes) -> dict[str, dict[str, float]]:
    """{"jax" | "torch": {n: GFLOP/s}}: median over repeats of a float32 n x n matmul (2 n^3
    FLOPs), per library; the machine's ceiling is the best of them."""
    import torch

    out: dict[str, dict[str, float]] = {"jax": {}, "torch": {}}
    matmul = jax.jit(jnp.matmul)
    for n in s.gemm:
        a, b = np.random.default_rng(n).standard_normal((2, n, n), dtype=np.float32)
        ja, jb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
        fns = {
            "jax": lambda ja=ja, jb=jb: matmul(ja, jb).block_until_ready(),
            "torch": lambda ta=ta, tb=tb: torch.mm(ta, tb),
        }
        times, _ = time_round_robin(fns, max(s.warmup, 1), 3 * s.repeats)
        for lib, t in times.items():
            out[lib][str(n)] = 2.0 * n**3 / median(t) / 1e9
    return out


def make_train_batch(cfg, params, s: Sizes) -> dict[str, np.ndarray]:
    """`random_train_batch` with behaviour log-probs = the model's own plus noise."""
    logp = jax.jit(lambda p, x: scoring.token_logprobs(cfg, p, x))
    return random_train_batch(s, lambda tokens: np.asarray(logp(params, tokens)))


def random_train_batch(s: Sizes, logp_fn) -> dict[str, np.ndarray]:
    """B x T random sequences with a ragged loss mask (position 0 has no context), behaviour
    log-probs = logp_fn(tokens) plus N(0, 0.3) noise (so the ESS < 1 and every term of P3O is
    live) and group z-scored random 0/1 rewards as advantages."""
    rng = np.random.default_rng(0)
    b, t = s.train_batch, s.train_seq
    tokens = rng.integers(1, s.vocab, (b, t)).astype(np.int32)
    lengths = rng.integers(t // 2, t + 1, b)
    pos = np.arange(t)[None]
    mask = (pos >= 1) & (pos < lengths[:, None])
    logp = logp_fn(tokens)
    blogp = np.where(mask, logp + rng.normal(0.0, 0.3, logp.shape), 0.0).astype(np.float32)
    adv = group_advantages(jnp.asarray(rng.integers(0, 2, b), jnp.float32), math.gcd(b, 4))
    return {
        "tokens": tokens,
        "attn_mask": np.ones((b, t), bool),
        "mask": mask.astype(np.float32),
        "behaviour_logp": blogp,
        "advantages": np.asarray(broadcast_to_tokens(adv, mask)),
    }


def jax_trainer(cfg, params, mesh, batch_np, objective: str = "p3o", num_microbatches: int = 1):
    """(step, losses): one ess_jax RL update per call (update.make_rl_step, the trainer's own
    jitted step with its state donated, over `num_microbatches`), on a copy of `params`."""
    tx = make_optimizer(OPTIM)
    state, state_sh = steps.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    step_fn = update_lib.make_rl_step(
        update_lib.UpdateConfig(cfg, ObjectiveConfig(name=objective), tx, num_microbatches),
        update_lib.StepKey(0),
        state_sh,
        sharding_lib.batch_sharding(mesh),
    )
    batch = sharding_lib.shard_batch(batch_np, mesh)
    held, losses = [state], []

    def step():
        state, metrics = step_fn(held.pop(), batch)
        held.append(jax.block_until_ready(state))
        losses.append(float(metrics["loss"]))

    return step, losses


def torch_p3o_loss(logits_BxTxV, tokens_BxT, blogp_BxT, adv_BxT, mask_BxT):
    """objectives.p3o with its defaults, in torch: -sg(min(rho, ess)) logp A + (1 - ess) k3,
    summed over valid tokens / their count; ess over the batch's valid tokens, stop-gradient."""
    import torch

    lp = torch.log_softmax(logits_BxTxV[:, :-1].float(), -1)
    lp = lp.gather(-1, tokens_BxT[:, 1:, None])[..., 0]
    valid = mask_BxT > 0
    logp = torch.where(valid, torch.nn.functional.pad(lp, (1, 0)), 0.0)
    log_ratio = logp - blogp_BxT
    lr = torch.where(valid, log_ratio.detach(), -torch.inf)
    shifted = torch.exp(lr - lr.max())  # ESS is scale-free: shift by the max, as kl.ess_sums
    n = valid.sum()
    ess = torch.clamp(shifted.sum() ** 2 / (n * (shifted**2).sum()), max=1.0)
    pg = -torch.minimum(torch.exp(log_ratio.detach()), ess) * logp * adv_BxT
    k3 = log_ratio + torch.exp(torch.clamp(-log_ratio, -10.0, 10.0)) - 1.0
    return ((pg + (1.0 - ess) * k3) * mask_BxT).sum() / n.clamp(min=1)


def torch_trainer(hf, batch_np, compiled: bool, device: str = "cpu", autocast=None):
    """(step, losses): one PyTorch training step per call on a copy of `hf`: forward, the same
    P3O loss, backward, AdamW (fused, torch's fastest CPU AdamW) with the same settings.
    On `device`; with `autocast` (a torch dtype) the forward runs under torch.autocast, float32
    master weights (bench/gpu.py: bfloat16 on CUDA, as ess_jax's compute dtype)."""
    import contextlib

    import torch

    net = copy.deepcopy(hf).to(device).train()
    opt = torch.optim.AdamW(
        net.parameters(),
        lr=OPTIM["lr"],
        weight_decay=OPTIM["weight_decay"],
        fused=True,
    )
    t = {k: torch.tensor(np.asarray(v), device=device) for k, v in batch_np.items()}
    tokens = t["tokens"].long()

    def loss_fn(tokens, blogp, adv, mask):
        ctx = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            logits = net(input_ids=tokens, use_cache=False).logits
        return torch_p3o_loss(logits, tokens, blogp, adv, mask)

    fn = torch.compile(loss_fn) if compiled else loss_fn
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = fn(tokens, t["behaviour_logp"], t["advantages"], t["mask"])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))

    return step, losses


def bench_train(hf, cfg, params, mesh, s: Sizes, compile_torch: bool) -> dict:
    """Median seconds per step of ess_jax, torch eager and (if it compiles) torch.compile."""
    batch = make_train_batch(cfg, params, s)
    fns, losses = {}, {}
    fns["ess_jax"], losses["ess_jax"] = jax_trainer(cfg, params, mesh, batch)
    fns["torch_eager"], losses["torch_eager"] = torch_trainer(hf, batch, compiled=False)
    errors = {}
    if compile_torch:
        step, losses["torch_compile"] = torch_trainer(hf, batch, compiled=True)
        try:  # the compile itself (minutes on 2 cores when inductor's cache is cold)
            step()
            fns["torch_compile"] = step
        except Exception as e:  # "where it compiles": report the peer as missing, go on
            errors["torch_compile"] = f"{type(e).__name__}: {str(e)[:300]}"
    times, compiles = time_round_robin(fns, s.warmup, s.repeats, prime=True)
    return {
        "tokens_per_step": s.train_batch * s.train_seq,
        "flops_per_step": train_flops(s, s.train_batch, s.train_seq),
        "seconds": {name: median(t) for name, t in times.items()},
        "rounds": times,  # seconds per round-robin round, for the paired ratios
        "first_loss": {name: v[0] for name, v in losses.items() if v},
        "errors": errors,
        "compiles_while_timed": compiles,
    }
