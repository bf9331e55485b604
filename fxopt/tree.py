"""Nested values (tuples, lists, dicts, Hugging Face ModelOutputs) as flat lists of tensors."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _torch_private


def flatten_tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nested output (tuples, lists, dicts, Hugging Face ModelOutputs), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in flatten_tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in flatten_tensors(v)]
    return []


def tensors_in(values) -> list[torch.Tensor]:
    """Every tensor among the leaves of a pytree (torch's own flattening: what export and forward see)."""
    return [v for v in _torch_private.tree_leaves(values) if isinstance(v, torch.Tensor)]
