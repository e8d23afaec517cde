"""Fixed-shape batches: left-padded, length-bucketed prompts for RL, right-padded
prompt+demonstration sequences for an SFT warm start, both endless, epoch-reshuffled
and resumable from a small JSON-able state that goes into checkpoints.

Axis names: B batch, P prompt length (a bucket), L sequence length, G group size.
"""

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ess_jax.data.tokenizer import encode_completion, encode_prompt, encode_prompts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The prompt widths: the sampler compiles one prefill per width it is given and pads nothing
# itself, so these few widths are its few programs (`bucket_width` for prompts that do not come
# through a PromptBatcher).
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def bucket_width(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int | None:
    """The width a prompt of `length` tokens is left-padded to: the smallest bucket >= length,
    or None if none fits."""
    return next((b for b in sorted(buckets) if b >= length), None)


class _EpochOrder:
    """Batch indices over epochs: a fresh permutation per epoch, remainder dropped.

    The permutation is a pure function of (seed, epoch), so (epoch, position) is the
    whole state: restoring it replays the stream exactly.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, shuffle: bool):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_examples < batch_size:
            # Dropping the remainder would leave zero batches per epoch: an endless loop.
            raise ValueError(f"{num_examples} examples are fewer than batch_size={batch_size}")
        self.num_examples, self.batch_size = num_examples, batch_size
        self.seed, self.shuffle = int(seed), shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_examples)

    def next_indices(self) -> np.ndarray:
        if self.position + self.batch_size > self.num_examples:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        idx = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return idx

    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_examples": self.num_examples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def restore(self, state: dict[str, Any]) -> None:
        for key in ("num_examples", "batch_size"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"cannot restore: checkpoint has {key}={state[key]}, "
                    f"this iterator has {getattr(self, key)}"
                )
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()


class PromptTooLongError(ValueError):
    """A prompt longer than the largest bucket (or too few prompts left without such ones)."""


def _describe(index: int, example: dict) -> str:
    return f"example {index} (prompt {str(example.get('prompt', ''))[:60]!r})"


class PromptBatcher:
    """Endless iterator of RL prompt batches.

    next(b) -> {"prompt_tokens": int32 [B, P] left-padded with the pad id,
                "prompt_mask": bool [B, P] (False on pads),
                "examples": the B example dicts, "indices": int64 [B] (into `examples`)},
    P = the smallest bucket >= the longest prompt in the batch. `state()` /
    `restore(state)` make the stream resumable exactly.

    Every prompt is tokenized at construction: one longer than the largest bucket is a
    PromptTooLongError naming it (before any work, not when its batch comes up), or with
    `drop_long=True` it is left out of the stream (`dropped`: their indices).
    """

    def __init__(
        self,
        examples: Sequence[dict],
        tokenizer: "PreTrainedTokenizerBase",
        batch_size: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        seed: int = 0,
        shuffle: bool = True,
        *,
        use_chat_template: bool | None = None,
        drop_long: bool = False,
    ):
        self.buckets = tuple(sorted(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive lengths, got {buckets}")
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer has no pad token")
        self.examples, self.tokenizer, self.batch_size = examples, tokenizer, batch_size
        ids = encode_prompts(tokenizer, [ex["prompt"] for ex in examples], use_chat_template)
        longest = self.buckets[-1]
        self.dropped = [i for i, row in enumerate(ids) if len(row) > longest]
        if self.dropped and not drop_long:
            i = self.dropped[0]
            raise PromptTooLongError(
                f"{_describe(i, examples[i])} has {len(ids[i])} tokens, more than the largest "
                f"bucket {longest} ({len(self.dropped)} of {len(examples)} prompts are longer)"
            )
        self._kept = np.array(sorted(set(range(len(ids))) - set(self.dropped)), np.int64)
        if self.dropped and len(self._kept) < batch_size:
            raise PromptTooLongError(
                f"only {len(self._kept)} of {len(examples)} prompts fit the largest bucket "
                f"{longest}: fewer than batch_size={batch_size}"
            )
        self._ids = [ids[i] for i in self._kept]
        self._order = _EpochOrder(len(self._kept), batch_size, seed, shuffle)

    def __iter__(self) -> "PromptBatcher":
        return self

    def bucket_for(self, length: int) -> int | None:
        """Smallest bucket >= length, or None if none fits (`bucket_width`)."""
        return bucket_width(length, self.buckets)

    def __next__(self) -> dict[str, Any]:
        pos = self._order.next_indices()
        ids = [self._ids[int(j)] for j in pos]
        idx = self._kept[pos]
        P = self.bucket_for(max(len(row) for row in ids))
        tokens_BxP = np.full((len(ids), P), self.tokenizer.pad_token_id, np.int32)
        mask_BxP = np.zeros((len(ids), P), bool)
        for b, row in enumerate(ids):
            tokens_BxP[b, P - len(row) :] = row
            mask_BxP[b, P - len(row) :] = True
        return {
            "prompt_tokens": tokens_BxP,
            "prompt_mask": mask_BxP,
            "examples": [self.examples[int(i)] for i in idx],
            "indices": idx,
        }

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position of the stream (epoch, position, seed, sizes)."""
        return self._order.state()

    def restore(self, state: dict[str, Any]) -> None:
        """Continue the stream exactly where `state()` was taken."""
        self._order.restore(state)

    def fork(self) -> "PromptBatcher":
        """An independent stream at the same position, sharing the tokenized prompts (the
        asynchronous sampler reads ahead on its own copy while the trainer's marks what it
        has trained on)."""
        other = copy.copy(self)
        other._order = copy.deepcopy(self._order)
        return other


class SFTBatcher:
    """Endless iterator of SFT batches (see `sft_batches`); resumable like PromptBatcher."""

    def __init__(
        self,
        examples: Sequence[dict],
        tokenizer: "PreTrainedTokenizerBase",
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        *,
        use_chat_template: bool | None = None,
    ):
        self.seq_len, self.examples = seq_len, examples
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            raise ValueError("tokenizer has no pad token")
        # Encode everything up front: SFT sets are small, and a too-long example
        # should fail at startup, not hours in.
        self._encoded: list[tuple[list[int], list[int]]] = []
        for i, ex in enumerate(examples):
            prompt = encode_prompt(tokenizer, ex["prompt"], use_chat_template)
            completion = encode_completion(tokenizer, ex["demonstration"])
            if len(prompt) + len(completion) > seq_len:
                raise ValueError(
                    f"{_describe(i, ex)}: prompt + demonstration + eos is "
                    f"{len(prompt) + len(completion)} tokens, more than seq_len={seq_len}"
                )
            self._encoded.append((prompt, completion))
        self._order = _EpochOrder(len(examples), batch_size, seed, shuffle)

    def __iter__(self) -> "SFTBatcher":
        return self

    def __next__(self) -> dict[str, Any]:
        idx = self._order.next_indices()
        B, L = len(idx), self.seq_len
        tokens_BxL = np.full((B, L), self.pad_id, np.int32)
        loss_mask_BxL = np.zeros((B, L), bool)
        token_mask_BxL = np.zeros((B, L), bool)
        for b, i in enumerate(idx):
            prompt, completion = self._encoded[int(i)]
            n = len(prompt) + len(completion)
            tokens_BxL[b, :n] = prompt + completion
            loss_mask_BxL[b, len(prompt) : n] = True
            token_mask_BxL[b, :n] = True
        return {
            "tokens": tokens_BxL,
            "loss_mask": loss_mask_BxL,
            "token_mask": token_mask_BxL,
            "indices": np.asarray(idx, np.int64),
        }

    def state(self) -> dict[str, Any]:
        return self._order.state()

    def restore(self, state: dict[str, Any]) -> None:
        self._order.restore(state)


def sft_batches(
    examples: Sequence[dict],
    tokenizer: "PreTrainedTokenizerBase",
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    **kwargs: Any,
) -> SFTBatcher:
    """Endless SFT batches: prompt + demonstration + eos, right-padded to seq_len.

    next(...) -> {"tokens": int32 [B, L], "loss_mask": bool [B, L] (True exactly
    where tokens[b, t] is a demonstration token or the final EOS: the positions a
    next-token loss should score), "token_mask": bool [B, L] (False on pads),
    "indices": int64 [B]}.
    """
    return SFTBatcher(examples, tokenizer, batch_size, seq_len, seed, **kwargs)
