"""Competition math answer sets from local files (AIME 2024, AIME 2025, AMC 2023): problem and
final answer, the held-out sets of the paper's E6 table.

The public releases name their fields differently, all accepted: `problem` or `question`
(HuggingFaceH4/aime_2024, math-ai/aime25, math-ai/amc23, opencompass/AIME2025), or `Problem`
and `Answer` (Maxwell-Jia/AIME_2024). Numeric answers are kept as text; a float with no
fractional part (AMC files store 27.0) is written as the integer.
"""

from ess_jax.data.datasets.base import LocalFilesBuilder
from ess_jax.data.datasets.records import RecordError, text_field


def _first(record: dict, names: tuple[str, ...], path: str, index: int) -> str:
    for name in names:
        if record.get(name) is not None:
            return text_field(record, name, path, index)
    raise RecordError(path, index, f"none of the fields {names} (has {sorted(record)})")


class Competition(LocalFilesBuilder, skip_registration=True):
    """Stores problem, answer, solution (may be empty) and id (the record's own, may be empty)."""

    FIELDS = ("problem", "answer", "solution", "id")

    def convert(self, record, path, index):
        answer = record.get("answer", record.get("Answer"))
        if isinstance(answer, float) and answer.is_integer():
            record = {**record, "answer": int(answer)}
        solution = record.get("solution", record.get("Solution"))
        ident = record.get("id", record.get("ID", record.get("unique_id")))
        return {
            "problem": _first(record, ("problem", "question", "Problem"), path, index),
            "answer": _first(record, ("answer", "Answer"), path, index),
            "solution": "" if solution is None else str(solution),
            "id": "" if ident is None else str(ident),
        }
