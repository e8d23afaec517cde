"""MATH-style data (Hendrycks MATH, MATH-500) from local files: `problem`, `solution`.

The answer is the `answer` field when present (MATH-500), else the last \\boxed{}
of the solution. `level` and `type` (MATH-500 calls it `subject`) are kept when present.
"""

from ess_jax.data.datasets.base import LocalFilesBuilder, last_boxed
from ess_jax.data.datasets.records import RecordError, text_field


class Math(LocalFilesBuilder, skip_registration=True):
    """Stores problem, solution, answer, level and type."""

    FIELDS = ("problem", "solution", "answer", "level", "type")

    def convert(self, record, path, index):
        solution = text_field(record, "solution", path, index)
        answer = text_field(record, "answer", path, index, required=False).strip()
        if not answer:
            answer = (last_boxed(solution) or "").strip()
        if not answer:
            raise RecordError(path, index, "no answer field and no \\boxed{} in the solution")
        kind = text_field(record, "type", path, index, required=False)
        return {
            "problem": text_field(record, "problem", path, index),
            "solution": solution,
            "answer": answer,
            "level": text_field(record, "level", path, index, required=False),
            "type": kind or text_field(record, "subject", path, index, required=False),
        }
