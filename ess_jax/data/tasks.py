"""Procedurally generated verifiable tasks with fixed, seeded, disjoint splits.

Each task draws random problems from a seeded stream and assigns every problem to
"train" or "test" by a hash of its canonical form (fixed by the task name and
problem alone, not by the seed), so no seed, size or difficulty setting can ever
put a test problem, or a trivial reordering of one ("34+12" for "12+34"), in
train. `examples(split, n)` is deterministic and prefix-stable: the first n
examples do not depend on how many more are asked for.

Prompts and completions are kept short for tiny char-level models:
    addition   "12+34="            -> "46"
      words=True: "Tom has 12 apples and buys 34 more. How many apples does he have now?"
                                   -> "12 + 34 = 46. The answer is 46."  (for chat LLMs)
    sort       "sort 3 1 2 2:"     -> "1 2 2 3"
    countdown  "make 22 from 3 5 7:" -> "3*5+7"  (any expression reaching 22 scores)
"""

import dataclasses
import hashlib
import zlib
from typing import ClassVar

import numpy as np

SPLITS = ("train", "test")


def _split_of(task: str, canonical_key: str, test_fraction: float) -> str:
    digest = hashlib.blake2b(f"{task}|{canonical_key}".encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "little") / 2.0**64 < test_fraction else "train"


@dataclasses.dataclass(frozen=True)
class Task:
    """Base class: subclasses set `name` and implement `_example(rng) -> (canonical_key,
    example)`, one random example."""

    name: ClassVar[str] = ""
    seed: int = 0
    test_fraction: float = 0.1
    train_size: int = 2000
    test_size: int = 200

    def __post_init__(self):
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")

    @property
    def reward(self) -> str:
        """Name of the reward function (in ess_jax.rewards.REWARDS) that scores this task."""
        return self.name

    def _example(self, rng: np.random.Generator) -> tuple[str, dict] | None:
        """One random problem, or None to reject the draw (e.g. a target out of range)."""
        raise NotImplementedError

    def examples(self, split: str, n: int | None = None) -> list[dict]:
        """The first `n` distinct problems of `split` (default: train_size / test_size).

        With an explicit `n` the result has exactly n examples or a ValueError says the
        problem space is too small; with the default size a small space yields what
        exists.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
        default = n is None
        n = (self.train_size if split == "train" else self.test_size) if default else n
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = np.random.default_rng(
            [self.seed, SPLITS.index(split), zlib.crc32(self.name.encode())]
        )
        out: list[dict] = []
        seen: set[str] = set()
        # Draw until n distinct problems, or until a long run of useless draws says the
        # space is (nearly) exhausted: deterministic, and never a hang on a small space.
        rarest = min(self.test_fraction, 1.0 - self.test_fraction)
        misses, patience = 0, int(200 / rarest)
        while len(out) < n and misses < patience + 20 * len(out):
            drawn = self._example(rng)
            if drawn is None or drawn[1]["prompt"] in seen:
                misses += 1
                continue
            key, example = drawn
            if _split_of(self.name, key, self.test_fraction) != split:
                misses += 1
                continue
            misses = 0
            seen.add(example["prompt"])
            out.append({"task": self.name, **example})
        if len(out) < n and not default:
            raise ValueError(
                f"{self.name}: found only {len(out)} distinct {split!r} problems, asked for {n}; "
                f"lower n or raise the difficulty ({self})"
            )
        return out


def _random_int(rng: np.random.Generator, digits: int) -> int:
    # Digit by digit so any `digits` works (int64 would overflow past 18 digits).
    first = rng.integers(0 if digits == 1 else 1, 10)
    rest = rng.integers(0, 10, size=digits - 1)
    return int(str(first) + "".join(str(d) for d in rest))


# Word-problem phrasings of a+b, for chat LLMs (capitalised: not for the char tokenizer).
_WORD_TEMPLATES = (
    "{name} has {a} {items} and buys {b} more. How many {items} does {pron} have now?",
    "{name} picked {a} {items} in the morning and {b} {items} in the afternoon. "
    "How many {items} did {pron} pick in total?",
    "A box holds {a} {items}. {name} puts {b} more {items} into it. "
    "How many {items} are in the box now?",
    "There are {a} {items} in a basket and {name} adds {b} more. "
    "How many {items} are in the basket?",
    "{name} had {a} {items}. A friend gave {obj} {b} more. How many {items} does {pron} have?",
)
_NAMES = (("Tom", "he", "him"), ("Anna", "she", "her"), ("Sam", "he", "him"))
_NAMES += (("Maria", "she", "her"), ("Leo", "he", "him"), ("Emma", "she", "her"))
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils")


def _pick(options: tuple, *key) -> object:
    digest = hashlib.blake2b("|".join(map(str, key)).encode(), digest_size=8).digest()
    return options[int.from_bytes(digest, "little") % len(options)]


@dataclasses.dataclass(frozen=True)
class AdditionTask(Task):
    """a+b with both operands of exactly `digits` digits (0-9 when digits=1).

    words=True phrases each problem as a short word problem and demonstrates a worked
    answer; the problems, answers and splits are those of words=False, in the same order
    (the phrasing is a hash of (seed, a, b), not a draw from the problem stream).
    """

    name: ClassVar[str] = "addition"
    digits: int = 2
    words: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")

    @property
    def reward(self) -> str:
        # A worked answer is not an exact match: score its final number instead.
        return "gsm8k" if self.words else self.name

    def _example(self, rng):
        a, b = _random_int(rng, self.digits), _random_int(rng, self.digits)
        answer = str(a + b)
        example = {"prompt": f"{a}+{b}=", "answer": answer, "demonstration": answer, "a": a, "b": b}
        if self.words:
            name, pron, obj = _pick(_NAMES, self.seed, a, b, "name")
            template = _pick(_WORD_TEMPLATES, self.seed, a, b, "template")
            items = _pick(_ITEMS, self.seed, a, b, "items")
            example["prompt"] = template.format(
                name=name, pron=pron, obj=obj, items=items, a=a, b=b
            )
            example["demonstration"] = f"{a} + {b} = {answer}. The answer is {answer}."
        return f"{min(a, b)}+{max(a, b)}", example


@dataclasses.dataclass(frozen=True)
class SortTask(Task):
    """Sort `length` integers in [0, max_value] ascending (duplicates allowed)."""

    name: ClassVar[str] = "sort"
    length: int = 4
    max_value: int = 9

    def __post_init__(self):
        super().__post_init__()
        if self.length < 1 or self.max_value < 1:
            raise ValueError(f"need length >= 1 and max_value >= 1, got {self}")

    def _example(self, rng):
        numbers = [int(x) for x in rng.integers(0, self.max_value + 1, size=self.length)]
        answer = " ".join(str(x) for x in sorted(numbers))
        prompt = "sort " + " ".join(str(x) for x in numbers) + ":"
        example = {"prompt": prompt, "answer": answer, "demonstration": answer, "numbers": numbers}
        # Any permutation of the same multiset shares a split: its answer is the same.
        return answer, example


@dataclasses.dataclass(frozen=True)
class CountdownTask(Task):
    """Reach `target` from `num_numbers` integers in [1, max_value] with + - * / ( ).

    The reference answer uses every number once in a left-to-right chain of random
    + - * (parenthesised where precedence needs it); the reward accepts any
    expression reaching the target with each number used at most once.
    """

    name: ClassVar[str] = "countdown"
    num_numbers: int = 3
    max_value: int = 9
    min_target: int = 1
    max_target: int = 100

    def __post_init__(self):
        super().__post_init__()
        if self.num_numbers < 1 or self.max_value < 1 or self.min_target > self.max_target:
            raise ValueError(f"bad countdown difficulty: {self}")

    def _example(self, rng):
        numbers = [int(x) for x in rng.integers(1, self.max_value + 1, size=self.num_numbers)]
        order = rng.permutation(self.num_numbers)
        expr, value, top_op = str(numbers[order[0]]), numbers[order[0]], "*"
        for i in order[1:]:
            n, op = numbers[i], "+-*"[rng.integers(0, 3)]
            if op == "*":
                expr = f"({expr})*{n}" if top_op in "+-" else f"{expr}*{n}"
                value *= n
            else:
                expr = f"{expr}{op}{n}"
                value = value + n if op == "+" else value - n
            top_op = op
        if not self.min_target <= value <= self.max_target:
            return None
        prompt = f"make {value} from " + " ".join(str(x) for x in numbers) + ":"
        example = {
            "prompt": prompt,
            "answer": expr,
            "demonstration": expr,
            "numbers": numbers,
            "target": value,
        }
        return f"{sorted(numbers)}->{value}", example


TASKS: dict[str, type[Task]] = {t.name: t for t in (AdditionTask, SortTask, CountdownTask)}


def get_task(name: str, **difficulty) -> Task:
    """The task `name` with difficulty / split options, e.g. get_task("addition", digits=3)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    cls = TASKS[name]
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = set(difficulty) - valid
    if unknown:
        raise ValueError(f"{name}: unknown options {sorted(unknown)}; valid: {sorted(valid)}")
    return cls(**difficulty)
