"""Beyond the paper: the paper's setup (configs/paper/common.py: DeepScaleR, 4K new tokens, bf16
training and sampler, 256 prompts x 4 samples per step) on the mixture-of-experts
Qwen3-30B-A3B (48 layers, 128 experts, 8 per token; ess_jax/config/presets.py KNOWN_MODELS),
with and without routing replay, on a v5p pod (v5p-64, the one preset the memory planner says
it fits: 56.8 GB per device of 85.5 usable; on v5e-256 17.7 of 14.4).

    .venv/bin/python -m ess_jax.main --config=configs/paper/moe_qwen3_30b_a3b.py:p3o \
        --config.model.source=/path/to/Qwen3-30B-A3B \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/moe/p3o

Arms: `p3o` (the trainer routes every token itself) and `p3o+replay` (it replays the experts
the sampler recorded: model.routing_replay sampler). On a TPU preset the experts run through
megablox's grouped matmul (model.moe_impl grouped: each token's 8 experts, not all 128;
model/grouped.py) and split over 8 expert ranks taken from the preset's data ranks
(common.finish `expert`; v5p-64: fsdp 4 x expert 8): the sample layout holds 16 of each
layer's 128 experts per device. The batch is split over the expert ranks too (a data axis
outside the MoE blocks: parallel/sharding.py), one row per device in a train micro-batch
(32 micro-batches of 32 rows per update).
`,tiny` is the CPU smoke run of every paper file (SmolLM2-135M, a dense model: no experts, no
replay). Compiled for v5p-64 with tools/compile_tpu.py (results/tpu/): the whole 48-layer
RL step is 39.8 GB per device of 85.5 usable, the planner's 41.1 GB +3.3% (held out of its
fit); its first 2, 4, 6 and 8 layers within 1.7%, the dispatched-rows term fitted to the 2-
and 8-layer ones (docs/memory.md, "Mixture of experts").
Unknown: everything a run would measure; this file is the shape of the run.
"""

from configs.paper import common

ARMS = ("p3o", "p3o+replay")
PRESETS = ("v5p-64",)  # tools/plan_memory.py; the default here
QWEN3_30B_A3B = "/path/to/Qwen3-30B-A3B"
EXPERT_RANKS = 8


def get_config(arg: str | None = None):
    if arg and "," not in arg:
        arg = f"{arg},{PRESETS[0]}"
    arm, preset = common.parse(arg, ARMS, PRESETS)
    objective, _, replay = arm.partition("+")
    c = common.with_objective(common.base(source=QWEN3_30B_A3B), objective)
    # One row per device in a train micro-batch: an MoE block computes its expert group's rows
    # (expert ranks x a device's, model/grouped.py), so at BATCHING's 4 rows per device its
    # dispatched rows are 32 sequences' (a 2-layer slice: 44.1 GB per device, 14.3 at 1)
    c = common.finish(c, preset, expert=EXPERT_RANKS, train_rows=1)
    if preset == "tiny":  # SmolLM2: dense
        return c
    c.model.routing_replay = "sampler" if replay else "none"
    if preset.startswith("v"):  # a TPU slice: megablox (GPUs: the dense expert path)
        c.model.moe_impl = "grouped"
    return c
