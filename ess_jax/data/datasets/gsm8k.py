"""GSM8K from local files: fields `question` and `answer` (reasoning, then '#### 42')."""

from ess_jax.data.datasets.base import LocalFilesBuilder
from ess_jax.data.datasets.records import RecordError, text_field


class Gsm8k(LocalFilesBuilder, skip_registration=True):
    """Stores question, solution (the original answer text) and answer (the final number)."""

    FIELDS = ("question", "solution", "answer")

    def convert(self, record, path, index):
        question = text_field(record, "question", path, index)
        solution = text_field(record, "answer", path, index)
        _, marker, final = solution.rpartition("####")
        final = final.strip().replace(",", "")
        if not marker or not final:
            raise RecordError(path, index, f"answer has no '#### <number>': {solution[-80:]!r}")
        return {"question": question, "solution": solution, "answer": final}
