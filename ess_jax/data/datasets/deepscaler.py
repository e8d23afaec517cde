"""DeepScaleR-Preview from local files: fields `problem`, `answer`, `solution`.

The public release is one JSON array (deepscaler.json): load it with
split_files={"train": "deepscaler.json"}.
"""

from ess_jax.data.datasets.base import LocalFilesBuilder
from ess_jax.data.datasets.records import text_field


class Deepscaler(LocalFilesBuilder, skip_registration=True):
    """Stores problem, answer and solution (solution may be empty)."""

    FIELDS = ("problem", "answer", "solution")

    def convert(self, record, path, index):
        return {
            "problem": text_field(record, "problem", path, index),
            "answer": text_field(record, "answer", path, index),
            "solution": text_field(record, "solution", path, index, required=False),
        }
