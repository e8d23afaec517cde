"""The params' shardings in the train and sample layouts: the model's logical axes
(`model.logical_axes`) mapped onto a mesh by sharding.py's rules. Its own module so that
imports flow one way: model uses sharding (row constraints), this uses both."""

from __future__ import annotations

from jax.sharding import Mesh

from ess_jax import model
from ess_jax.sharding import SAMPLE_RULES, TRAIN_RULES, tree_shardings


def param_shardings(cfg: model.ModelConfig, mesh: Mesh, mode: str = "train"):
    """Shardings of the model params in the `train` or `sample` layout."""
    rules = {"train": TRAIN_RULES, "sample": SAMPLE_RULES}.get(mode)
    if rules is None:
        raise ValueError(f"unknown sharding mode {mode!r}; valid: train, sample")
    return tree_shardings(model.abstract_params(cfg), model.logical_axes(cfg), mesh, rules)
