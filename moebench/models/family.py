"""What a family declares about itself, in its own model file: one Family value (its module's FAMILY).

Everything moebench needs to know about a family beyond what its modules compute lives here: the model_type
values config.json names it by, the config fields it fills or names its own way, the layer and rotary kinds its
config may hold, how its published folders name or shape tensors unlike its modules, how its MLX conversions lay
out the routed experts, and the named shapes `moebench make-random` writes. The readers (moebench.checkpoint,
moebench.tools.presets) ask this declaration and never the family's module by attribute name, so a new family is
one model file and its registration (moebench.models.FAMILY_MODULES).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .args import ModelArgs


class StoredTensors(Protocol):
    """What a stored layout may do to a checkpoint's tensors before they load (moebench.checkpoint.files'
    TensorStore): read their names and shapes, rename, take and put back, and leave out with a reason."""

    def names(self) -> list[str]: ...
    def peek(self, name: str) -> mx.array: ...
    def where(self, name: str) -> str: ...
    def rename(self, name: str, new: str) -> None: ...
    def take(self, name: str) -> mx.array: ...
    def put(self, name: str, value: mx.array, where: str) -> None: ...
    def skip(self, name: str, why: str) -> None: ...


@dataclass(frozen=True)
class Preset:
    """A named model shape for `moebench make-random`: a config.json as published (or cut down to fit a CPU)."""

    name: str
    summary: str
    config: dict


def no_fields(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    return {}


@dataclass(frozen=True, eq=False)  # one value a family: compared and hashed as itself
class Family:
    """One family's declaration.

    model_types: config.json's model_type values it reads (the first is its name).
    model: builds the model from ModelArgs.
    config_fields: ModelArgs fields its config.json leaves out or names its own way (read before any field is
        checked; the common reader then checks them).
    own_fields: ModelArgs fields only this family has, read and checked by it (e.g. `family_args`).
    layer_types / rope_types: what config.json's `layer_types` and `rope_type` may hold.
    stored_layout: renames and reshapes the tensors of its published folders into its modules' names (None:
        stored as the modules name them); returns the args with quantization entries renamed alike.
    expert_layout: how its MLX conversions store the routed experts ('stacked' or 'per-expert').
    unquantized: tensor name endings its MLX conversions keep float (mlx-lm quantizes only its Linear layers, and
        some families' routers are none), which make-random keeps float too.
    presets: its named shapes.
    """

    model_types: tuple[str, ...]
    model: Callable[[ModelArgs], Any]
    config_fields: Callable[[dict[str, Any]], dict[str, Any]] = no_fields
    own_fields: Callable[[dict[str, Any], str], dict[str, Any]] = no_fields
    layer_types: tuple[str, ...] = ("full_attention",)
    rope_types: tuple[str, ...] = ("default",)
    stored_layout: Callable[[StoredTensors, ModelArgs], ModelArgs] | None = None
    expert_layout: str = "stacked"
    unquantized: tuple[str, ...] = ()
    presets: tuple[Preset, ...] = ()

    @property
    def name(self) -> str:
        return self.model_types[0]
