"""Walks over the RunConfig schema, for the tests that keep a rule list complete (admission's
place rules, the service's limits): every section model, and the types a field may hold."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel


def field_types(annotation: Any) -> list[Any]:
    """The annotation and every type nested in it (unions, containers, Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return field_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, dict, tuple, set, frozenset):
        return [annotation, *(t for a in typing.get_args(annotation) for t in field_types(a))]
    return [annotation]


def section_models(model: type[BaseModel], seen: dict[str, type[BaseModel]] | None = None
                   ) -> dict[str, type[BaseModel]]:
    """Every model reachable from ``model``'s fields, by class name (names are unique: the
    rule lists key on them)."""
    seen = {} if seen is None else seen
    if model.__name__ in seen:
        assert seen[model.__name__] is model, f"two RunConfig classes are called {model.__name__}"
        return seen
    seen[model.__name__] = model
    for info in model.model_fields.values():
        for t in field_types(info.annotation):
            if isinstance(t, type) and issubclass(t, BaseModel):
                section_models(t, seen)
    return seen
