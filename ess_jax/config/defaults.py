"""The default experiment config. Experiment files in configs/ start from it and override.

Every off-policy knob of docs/method.md is here and off by default: rollout.temperature=1,
top_k=0, top_p=1, precision=float32, lag=0, external_fraction=0, train.updates_per_batch=1.
"""

from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mesh = {"data": 1, "fsdp": -1, "tensor": 1}  # -1: all remaining devices

    c.model = ml_collections.ConfigDict()
    c.model.source = "embedded"  # embedded | smollm2 | path to an HF dir or a .gguf file
    c.model.dtype = "float32"  # trainer compute: float32 | bfloat16 | float16 (float32 masters)
    # > 0: full-sequence forwards compute the LM head and attention this many tokens at a time
    c.model.logits_chunk = 0
    c.model.remat = False  # recompute each block in the backward pass (long sequences)
    # attention of training forwards and the prefill: einsum | cudnn (NVIDIA GPU, bf16) | xla
    # | splash (TPU, float32 / bf16; training and scoring forwards only)
    c.model.attention_impl = "einsum"
    # embedded model only (a char-level Llama-style decoder trained from scratch):
    c.model.hidden_size = 64
    c.model.intermediate_size = 192
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 16
    c.model.tie_embeddings = True
    c.model.rope_theta = 10000.0
    c.model.init_seed = 0
    # LoRA (ess_jax/model/lora.py): rank 0 = full fine-tuning; rank > 0 freezes the base and
    # trains adapters x W + (alpha / rank) x A B on the `targets` matmuls, SFT warm start too
    c.model.lora = ml_collections.ConfigDict()
    c.model.lora.rank = 0
    c.model.lora.alpha = 16.0
    # dropout on the adapters' inputs in the trainer's forwards only (model/lora.py): > 0 makes
    # the trainer's log-probs a noisy copy of the sampler's, an on-policy ratio no longer 1
    c.model.lora.dropout = 0.0
    c.model.lora.targets = "q,k,v,o,gate,up,down"  # comma-separated, any of these seven
    # QLoRA (ess_jax/model/quant.py): the frozen base's seven block matrices in the param dtype
    # ("compute"), or stored as "int8" / "int4" codes with per-output-channel scales and
    # dequantized inside the forward; needs rank > 0
    c.model.lora.base_precision = "compute"

    c.task = ml_collections.ConfigDict()
    c.task.name = "addition"  # addition | sort | countdown | gsm8k | deepscaler | math
    c.task.reward = "addition"
    c.task.difficulty = {}  # synthetic tasks' dials, e.g. {"digits": 2}
    c.task.manual_dir = ""  # local files of gsm8k / deepscaler / math
    # where the tfds build of those files goes ("": <manual_dir>/_tfds); set it when manual_dir
    # is read-only
    c.task.cache_dir = ""
    c.task.test_split = "test"
    c.task.num_train = 0  # 0: all
    c.task.num_test = 0

    c.data = ml_collections.ConfigDict()
    c.data.prompts_per_step = 16
    c.data.buckets = (16, 32, 64, 128, 256, 512)  # prompt lengths are padded up to these
    # a prompt longer than the largest bucket stops the run at startup, naming it; True leaves
    # such prompts out (train and held-out) and logs how many
    c.data.drop_long_prompts = False

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8  # G samples per prompt
    c.rollout.max_new_tokens = 16
    c.rollout.temperature = 1.0
    c.rollout.top_k = 0
    c.rollout.top_p = 1.0
    # float32 | bfloat16 | float16 | fp8 | fp8_e4m3_tensor | fp8_e5m2 | int8 | int4 | fp8_act: the
    # sampler's weights and compute (ess_jax/sampling/precision.py says what each quantizes)
    c.rollout.precision = "float32"
    c.rollout.lag = 0  # sample with the policy `lag` versions old
    c.rollout.external_fraction = 0.0  # share of each group drawn by another model
    c.rollout.external_checkpoint = ""
    c.rollout.external_precision = "float32"
    # the sampler's KV cache: compute (its compute dtype) | bfloat16 | fp8 (float8_e4m3fn, one
    # float32 scale per token and kv head; ess_jax/model/kv_cache.py)
    c.rollout.kv_cache_precision = "compute"
    c.rollout.stop_ids = ()  # () -> the tokenizer's EOS (and chat end tokens)
    c.rollout.advantage_mode = "grpo"  # grpo | drgrpo | rloo
    c.rollout.dynamic_sampling = False  # DAPO: drop groups whose rewards are all equal
    # with dynamic_sampling: > 0 refills the dropped groups from up to this many extra rounds
    # of fresh prompts (DAPO's resampling); 0 masks them out (ess_jax/rl/dynamic_sampling.py)
    c.rollout.max_resample_rounds = 0
    c.rollout.sample_microbatches = 1  # sample the rollout batch in this many sampler calls
    c.rollout.overlong_buffer = 0  # DAPO soft overlong penalty buffer (tokens); 0: off
    # train.mode "async" only (ess_jax/rl/actor_learner.py): the most steps between the policy
    # version that drew a batch and the step that trains on it; the sampler waits, never drops
    c.rollout.max_lag = 1
    # train.mode "async": ESS pacing (ess_jax/rl/pacing.py) lowers the lag budget while the
    # running step ESS is under this target and raises it (up to max_lag) above; 0: off
    c.rollout.target_ess = 0.0

    # Every ObjectiveConfig field, so each can be set from the command line; None (a typed
    # placeholder) means the objective's own default (DAPO / GSPO clips from their papers).
    c.objective = ml_collections.ConfigDict()
    c.objective.name = "p3o"  # p3o | p3o_dual | grpo | dapo | cispo | gspo | gspo_token | ...
    # Statistics each micro-batch's loss uses (train.num_microbatches > 1; all agree at 1):
    #   step: ESS and token count of the whole optimizer step (micro-batch / device invariant);
    #     for p3o / p3o_dual it costs M - 1 extra micro-batch forwards at M >= 3, 2 at M = 2
    #     (+24% per update at 4 micro-batches on bench/cpu.py's CPU model; BENCHMARKS.md)
    #   microbatch: the reference code's default: ESS per micro-batch (pooled over devices),
    #     divided by the token count of the whole optimizer step
    #   microbatch_local: ESS and token count per micro-batch, mean over micro-batches
    c.objective.ess_scope = "step"
    # KL(pi || pi_b) of P3O: k3 | k1 | k2 (sampled token) | full (whole vocabulary, p3o only: pi_b
    # re-scored by a second forward per update; needs model.logits_chunk > 0, a float32 sampler
    # and temperature > 0; docs/configs.md, "The KL term")
    c.objective.kl_estimator = "k3"
    c.objective.ref_kl_estimator = "k3"
    c.objective.aggregation = "token_mean"
    c.objective.constant_normalizer = 1.0
    c.objective.clip_eps_low = placeholder(float)
    c.objective.clip_eps_high = placeholder(float)
    c.objective.dual_version = "mixture"  # two_kl | mixture
    c.objective.dual_kl_gate = 1e-6
    c.objective.behaviour_weight_cap = placeholder(float)
    c.objective.beta_kl = 0.0
    c.objective.beta_ent = 0.0
    c.objective.p3o_drop_kl = False  # ablation: P3O without its (1 - ESS) KL term ("cap only")
    c.objective.p3o_drop_cap = False  # ablation: P3O weighting by sg(rho), no cap ("KL only")
    c.objective.is_level = "token"  # grpo_tis / grpo_mis: token | sequence behaviour weight
    c.objective.is_cap = 2.0  # TIS truncation C (MIS: upper edge of the kept band)
    c.objective.is_cap_low = 0.0  # MIS: lower edge of the kept band (verl's default: 1 / is_cap)
    c.objective.is_veto = 0.0  # TIS / MIS: zero a sequence with any w_t below it; 0 off (verl 1e-4)
    c.objective.m2_threshold = 0.04  # m2po: bound on the kept tokens' mean (log rho)^2 (AReaL)
    c.objective.m2po_form = "mask"  # m2po: "mask" | "areal" | "authors" (m2po_forms.py)
    c.objective.vcpo_base_ess_ratio = 1.0  # vcpo: lr x sqrt(min(1, (ESS/B) / this)) (theirs)
    c.objective.vcpo_is_cap = 8.0  # vcpo: sequence IS weight truncation (rollout_is_threshold)
    c.objective.vcpo_baseline = "paper"  # vcpo: baseline weight, "paper" | "authors" (vcpo.py)
    # dppo: mask A > 0 tokens with pi - pi_b > high, A <= 0 ones with pi - pi_b < -low; kl_tau
    # weighs (log rho)^2 (prime-rl's defaults)
    c.objective.dppo_mask_low = 0.2
    c.objective.dppo_mask_high = 0.2
    c.objective.dppo_kl_tau = 1e-3
    # kept bands of w = pi_old / pi_b: icepop per token, seq_mis its product over the sequence,
    # geo_rs its geometric mean over the sequence (OpenRLHF's and verl's defaults)
    c.objective.icepop_low = 0.5
    c.objective.icepop_high = 5.0
    c.objective.seq_mis_low = 0.5
    c.objective.seq_mis_high = 2.0
    c.objective.geo_rs_low = 0.999
    c.objective.geo_rs_high = 1.001

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-5
    c.optim.warmup_steps = 0
    c.optim.schedule = "constant"  # constant | cosine (to lr * final_lr_fraction), after warmup
    c.optim.final_lr_fraction = 1.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.weight_decay = 0.0
    c.optim.max_grad_norm = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100
    c.train.updates_per_batch = 1  # > 1: several optimizer steps per rollout batch
    c.train.num_microbatches = 1
    c.train.checkpoint_every = 50
    c.train.keep_checkpoints = 2
    # Write the final params (and tokenizer) as a Hugging Face checkpoint to <workdir>/hf: an SFT
    # warm start shared by many RL runs (model.source=<workdir>/hf), or an external model.
    c.train.export_hf = False
    # Resume from the newest checkpoint that reads back, with a warning, when newer ones are
    # truncated or corrupted (they are moved aside, never deleted); False: stop with the error.
    c.train.restore_fallback = True
    # sync: sample then train on every device in turn; async: a sampler thread on a rollout
    # mesh and the trainer on a train mesh at once (ess_jax/rl/actor_learner.py, docs/running.md)
    c.train.mode = "sync"
    c.train.async_rollout_devices = 0  # async: devices of the rollout mesh (0: half); train: rest
    c.train.async_rollout_tensor = 1  # async: the rollout mesh's tensor axis (data: the rest)
    c.train.sync_every = 1  # async: push the trainer's params to the sampler every k RL steps

    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0  # supervised warm start on demonstrations before RL
    c.sft.batch_size = 64
    c.sft.lr = 3e-3
    c.sft.warmup_steps = 20
    c.sft.seq_len = 32
    c.sft.demo_noise = 0.0  # share of demonstrations with one wrong digit (a noisy teacher)

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 25  # 0: no eval
    c.eval.num_examples = 128
    c.eval.batch_size = 32
    c.eval.k = 4
    c.eval.temperature = 1.0
    c.eval.max_new_tokens = 16
    # the sampler's format for held-out eval (rollout.precision's values): float32 scores the
    # policy itself; a lower one (bfloat16) holds the sampler's copy in that format (with
    # model.lora the merge writes it straight in: no float32 merged copy), and the eval numbers
    # then include the format's rounding (docs/configs.md; docs/memory.md: 8B LoRA on one GPU)
    c.eval.precision = "float32"
    # eval's KV cache (rollout.kv_cache_precision's values): "compute" keeps keys and values in
    # eval.precision's compute dtype; bfloat16 / fp8 shrink the cache of long evals, and the
    # eval numbers then include its rounding
    c.eval.kv_cache_precision = "compute"
    return c
