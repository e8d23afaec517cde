"""Shared by the parts of bench/cpu.py: the sizes of a run, the one model both sides use,
the FLOP model behind MFU, and the timing helpers. Not a command: run bench/cpu.py.

Axis alphabet: B batch, T time, S attended (key) length, D model width, H query heads,
N kv heads, K head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

# jax's monitoring event for one XLA compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT)
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
MODES = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything that sets the work of a run (bench/cpu.py presets these; --set overrides)."""

    # the Llama both sides run (defaults: ~32M params, the model of BENCHMARKS.md's figures)
    dim: int = 512
    mlp: int = 1408
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 8192
    gemm: tuple[int, ...] = (1024, 2048)  # square float32 matmul sizes for the ceiling
    train_batch: int = 8
    train_seq: int = 256
    decode_batches: tuple[int, ...] = (1, 32)
    decode_modes: tuple[str, ...] = MODES
    prompt: int = 64  # prompt width of the decode bench (rows left-padded to it)
    gen: int = 128  # L: new tokens; decode is also measured at 2L
    rl_prompts: int = 8
    rl_group: int = 4
    rl_prompt: int = 32
    rl_gen: int = 64
    microbatches: tuple[int, ...] = (1, 4)
    # the ESS overhead compares p3o with grpo; add e.g. grpo_tis to see an old-logp pass
    rl_objectives: tuple[str, ...] = ("p3o", "grpo")
    warmup: int = 1
    repeats: int = 3

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            vals = v if isinstance(v, tuple) else (v,)
            if f.name == "decode_modes":
                if not vals or set(vals) - set(MODES):
                    raise ValueError(f"sizes.decode_modes={v!r}: each must be one of {MODES}")
                continue
            if f.name == "rl_objectives":
                from ess_jax.objectives import OBJECTIVES

                if not {"p3o", "grpo"} <= set(vals) or set(vals) - set(OBJECTIVES):
                    raise ValueError(
                        f"sizes.rl_objectives={v!r}: must hold p3o and grpo, each one of "
                        f"{sorted(OBJECTIVES)}"
                    )
                continue
            lowest = 0 if f.name == "warmup" else 1
            if not vals or any(not isinstance(x, int) or x < lowest for x in vals):
                raise ValueError(f"sizes.{f.name}={v!r}: must be integers >= {lowest}")
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"sizes: dim={self.dim} must divide by heads={self.heads}, and heads by "
                f"kv_heads={self.kv_heads}"
            )
        if self.gen < 2:
            raise ValueError(f"sizes.gen={self.gen}: decode needs at least 2 new tokens")
        rows = self.rl_prompts * self.rl_group
        for m in self.microbatches:
            if rows % m:
                raise ValueError(
                    f"sizes.microbatches={self.microbatches}: {m} does not divide the RL batch "
                    f"of rl_prompts * rl_group = {rows} rows"
                )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# ----------------------------------------------------------------------------- the model


def hf_shape(s: Sizes) -> dict:
    """The Hugging Face config fields `s` sets, SDPA attention, pad id 0, no BOS / EOS (the
    bench generates exactly the requested tokens), untied embeddings."""
    return dict(
        vocab_size=s.vocab,
        hidden_size=s.dim,
        intermediate_size=s.mlp,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )


def hf_llama(s: Sizes):
    """A random Hugging Face LlamaForCausalLM (torch seed 0), float32, eval mode: matrices
    N(0, 1 / fan_in), norm weights 1 + N(0, 0.2^2) (as tests/test_model.py)."""
    import torch
    import transformers

    hf_cfg = transformers.LlamaConfig(
        **hf_shape(s), head_dim=s.head_dim, max_position_embeddings=4096, rms_norm_eps=1e-5
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    # HF's init (std 0.02) leaves attention nearly uniform, so a wrong q or k would barely
    # move the logits; unit-scale weights make the parity check see every tensor.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return hf


def one_device_mesh():
    """The bench's mesh: one device, one process using every core (more CPU devices, as the
    tests' fake 8, would only split the same cores)."""
    from ess_jax.parallel import sharding

    return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def build_models(s: Sizes, mesh):
    """(hf, cfg, params): the torch model and the same weights in ess_jax, passed through the
    real exporter/loader (save_pretrained -> weights.load_hf) so both sides run identical
    weights; params are placed on `mesh` in the train layout."""
    from ess_jax.io import weights

    hf = hf_llama(s)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        cfg, params = weights.load_hf(d, mesh)
    return hf, cfg, params


def max_logit_diff(hf, cfg, params, tokens_BxT) -> float:
    """max |logits_torch - logits_ess_jax| over a batch (no padding): 0 up to float rounding
    when both sides hold the same weights."""
    import numpy as np
    import torch

    from ess_jax.model import decoder as model_lib

    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(np.asarray(tokens_BxT), dtype=torch.long)).logits
    ours = model_lib.apply(cfg, params, jax.numpy.asarray(tokens_BxT))
    return float(np.max(np.abs(np.asarray(ours) - ref.numpy())))


def left_padded_prompts(batch: int, width: int, vocab: int, seed: int):
    """(tokens_BxP int32, mask_BxP bool): random prompts of lengths in [width/2, width], the
    first one full, left-padded with id 0 (the sampler's and `generate`'s layout)."""
    import numpy as np

    rs = np.random.RandomState(seed)
    lens = rs.randint(width // 2, width + 1, batch)
    lens[0] = width
    mask = np.arange(width)[None] >= (width - lens)[:, None]
    tokens = np.where(mask, rs.randint(1, vocab, (batch, width)), 0).astype(np.int32)
    return tokens, mask


# ----------------------------------------------------------------------------- FLOP model


def matmul_params(s: Sizes) -> int:
    """Weights that take part in a matmul for every token: each block's q, k, v, o and the three
    MLP matrices, plus the LM head. The input embedding is a gather (no FLOPs); norm vectors
    are negligible."""
    d, h, n, k, f = s.dim, s.heads, s.kv_heads, s.head_dim, s.mlp
    per_layer = d * h * k + 2 * d * n * k + h * k * d + 3 * d * f
    return s.layers * per_layer + s.vocab * d


def forward_flops(s: Sizes, batch: int, queries: int, keys: int) -> float:
    """One forward over `batch` rows of `queries` new tokens each attending over `keys`
    positions: 2 FLOPs (a multiply-add) per matmul weight per token, plus attention, whose
    q.k^T and p.v products cost 2 * H * K * keys each per query per layer."""
    tokens = batch * queries
    return 2.0 * matmul_params(s) * tokens + 4.0 * s.layers * s.heads * s.head_dim * keys * tokens


def train_flops(s: Sizes, batch: int, seq: int) -> float:
    """One training step (forward + backward, the backward costing two forwards):
        6 * N * B * T  +  12 * L * H * K * T * B * T
    with N = matmul_params. This is the PaLM (appendix B) MFU convention: the whole T x T
    attention is counted, causal masking or not, and the optimizer update is not."""
    return 3.0 * forward_flops(s, batch, seq, seq)


def scalar_overrides(assignments) -> dict:
    """{field: value} of `--set NAME=VALUE` items naming scalar Sizes fields (bench/lora.py's
    and bench/packing.py's flag), each value in its field's type."""
    out = {}
    for item in assignments:
        k, v = item.split("=")
        out[k] = type(getattr(Sizes(), k))(v)
    return out


# ----------------------------------------------------------------------------- timing


def median(xs) -> float:
    return float(statistics.median(xs))


def paired(num, den) -> float:
    """Median over rounds of num[i] / den[i]: both sides of a ratio from the same round of a
    round-robin (seconds apart), so a change of machine speed between rounds cancels. On a
    shared 2-core machine the speed drifts by tens of percent over minutes; a ratio of the two
    medians mixes rounds and carries that drift."""
    return median([a / b for a, b in zip(num, den, strict=True)])


def time_round_robin(
    fns: dict[str, Callable[[], Any]],
    warmup: int,
    repeats: int,
    warm: dict[str, Callable[[], Any]] | None = None,
    prime: bool = False,
) -> tuple[dict[str, list], list[str]]:
    """Call every fn `warmup` times untimed (or its `warm` stand-in: a cheaper call that pays
    the same one-time costs), then `repeats` times, in turn, so that a load change on the
    machine hits every competitor alike. Each fn must block until its work is done; what it
    returns is recorded if it is its own measured seconds (a float or a dict of them), else
    its wall time is.
    With `prime`, each timed call follows an untimed call of the same fn, so that it never
    runs right after the other framework: on a 2-core CPU a JAX train step right after a
    torch step takes 2.9-3.2 s, right after a JAX step 2.5-3.0 s (BENCHMARKS.md, "How the
    bench measures"), and in a training loop a step follows a step of its own kind.
    Returns ({name: [result per repeat]}, names of the XLA compilations while timing)."""
    warm = warm or {}
    for _ in range(warmup):
        for name, fn in fns.items():
            warm.get(name, fn)()
    out: dict[str, list] = {name: [] for name in fns}
    with CompileCounter() as compiles:
        for r in range(repeats):
            names = list(fns) if r % 2 == 0 else list(fns)[::-1]  # no fixed first or last
            for name in names:
                if prime:
                    fns[name]()
                t0 = time.perf_counter()
                got = fns[name]()
                own = isinstance(got, (float, dict))
                out[name].append(got if own else time.perf_counter() - t0)
    return out, compiles.names


class CompileCounter:
    """Names of the XLA compilations that happen while it is active (jax's monitoring event):
    after warm-up a timed loop should compile nothing."""

    def __init__(self):
        self.names: list[str] = []

    def _on_event(self, event: str, duration: float, **kw) -> None:
        if event == _COMPILE_EVENT:
            self.names.append(str(kw.get("fun_name", "?")))

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)
