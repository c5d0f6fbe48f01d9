"""Tensors inside the layer's state objects (dataclasses, dicts, lists and tuples): taken out,
put back, or the structure copied around the same tensors."""

from __future__ import annotations

import copy
import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where `take_tensors` took the tensor `tensors[index]` out of a structure."""

    index: int


def map_leaves(value, is_leaf, leaf):
    """`value` rebuilt with `leaf(x)` for every x it holds where `is_leaf(x)`, through
    dataclasses (shallow copies with their fields replaced, no __init__: its checks want the
    original fields), dicts, lists and tuples. Other objects are kept as they are."""
    if is_leaf(value):
        return leaf(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = copy.copy(value)
        for field in dataclasses.fields(value):
            mapped = map_leaves(getattr(value, field.name), is_leaf, leaf)
            object.__setattr__(copied, field.name, mapped)
        return copied
    if isinstance(value, dict):
        return {key: map_leaves(item, is_leaf, leaf) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(map_leaves(item, is_leaf, leaf) for item in value)
    return value


def take_tensors(value, tensors: list[torch.Tensor]):
    """`value` with every tensor it holds replaced by a `TensorSlot` into `tensors`, where the
    tensor is appended (tensors inside objects other than dataclasses, dicts, lists and tuples
    stay where they are)."""

    def take(tensor):
        tensors.append(tensor)
        return TensorSlot(len(tensors) - 1)

    return map_leaves(value, lambda item: isinstance(item, torch.Tensor), take)


def put_tensors(value, tensors):
    """The inverse of `take_tensors`: every `TensorSlot` replaced by its tensor."""
    return map_leaves(
        value, lambda item: isinstance(item, TensorSlot), lambda slot: tensors[slot.index]
    )


def structural_copy(value):
    """`value` with every dataclass, dict, list and tuple in it copied (shallowly), around the
    same tensors: what a consumer may take apart (set fields to None) without touching `value`."""
    return map_leaves(value, lambda item: isinstance(item, torch.Tensor), lambda tensor: tensor)
