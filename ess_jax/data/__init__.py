"""Prompts for RL and SFT: synthetic tasks, local-file datasets, tokenizers, batching, and the
row layout of a rollout batch (`RowLayout`).

A leaf package: imports nothing else from ess_jax (and no jax).
"""

from ess_jax.data.batching import (
    DEFAULT_BUCKETS,
    PromptBatcher,
    PromptTooLongError,
    SFTBatcher,
    bucket_width,
    sft_batches,
)
from ess_jax.data.datasets import (
    BUILDERS,
    PROMPT_TEMPLATES,
    CacheDirError,
    LocalDataset,
    get_builder,
    load_dataset,
)
from ess_jax.data.layout import RowLayout, repeat_for_group
from ess_jax.data.tasks import TASKS, AdditionTask, CountdownTask, SortTask, Task, get_task
from ess_jax.data.tokenizer import (
    DEFAULT_ALPHABET,
    UnencodableError,
    char_tokenizer,
    decode_completion,
    encode_completion,
    encode_prompt,
    encode_prompts,
    load_tokenizer,
)

__all__ = [
    "BUILDERS",
    "CacheDirError",
    "DEFAULT_ALPHABET",
    "DEFAULT_BUCKETS",
    "PROMPT_TEMPLATES",
    "TASKS",
    "AdditionTask",
    "CountdownTask",
    "LocalDataset",
    "PromptBatcher",
    "PromptTooLongError",
    "RowLayout",
    "SFTBatcher",
    "SortTask",
    "Task",
    "UnencodableError",
    "bucket_width",
    "char_tokenizer",
    "decode_completion",
    "encode_completion",
    "encode_prompt",
    "encode_prompts",
    "get_builder",
    "get_task",
    "load_dataset",
    "load_tokenizer",
    "repeat_for_group",
    "sft_batches",
]
