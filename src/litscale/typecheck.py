"""Checking config values against constructor annotations.

Why not OmegaConf structured configs: they cover int/float/str/bool/enums, but not unions,
``Literal`` or ranges, and the constructors already carry these types; checking against
the signatures keeps one source of truth.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union

from litscale.constraints import Range
from litscale.errors import ConfigError

_EMPTY = inspect.Parameter.empty


def locate_target(target: str, path: str) -> Any:
    """The object a ``_target_`` names, or a one-line error."""
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception as error:  # Hydra wraps ImportError/AttributeError in its own types
        raise ConfigError(f"{path}._target_={target!r} cannot be imported: {error}".splitlines()[0]) from None


def _parameters(function: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}


def _hints(function: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception:  # unresolved forward references: fall back to raw annotations
        return {}


def _signature_chain(target: Any) -> list[Any]:
    """The ``__init__``s whose keywords a class accepts: each one that takes ``**kwargs``
    is assumed to forward them to the next class in its MRO."""
    if not inspect.isclass(target):
        return [target]
    chain = []
    for cls in target.__mro__:
        if "__init__" not in vars(cls) or cls is object:
            continue
        chain.append(cls.__init__)
        if not any(p.kind is p.VAR_KEYWORD for p in _parameters(cls.__init__).values()):
            break
    return chain


def signature_annotations(target: Any) -> dict[str, Any]:
    """Keyword name -> annotation (``Any`` where none) for a class or function."""
    annotations: dict[str, Any] = {}
    for function in _signature_chain(target):
        hints = _hints(function)
        for name, param in _parameters(function).items():
            if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                continue
            annotations.setdefault(name, hints.get(name, Any))
    return annotations


def forwards_unknown_kwargs(target: Any) -> bool:
    """True when the last signature in the chain still takes ``**kwargs`` (anything goes)."""
    chain = _signature_chain(target)
    return bool(chain) and any(p.kind is p.VAR_KEYWORD for p in _parameters(chain[-1]).values())


def check_value(value: Any, annotation: Any) -> str | None:
    """None when ``value`` fits ``annotation``, else a description of what was expected."""
    return None if _fits(value, annotation) else describe(annotation)


def _fits(value: Any, annotation: Any) -> bool:
    if annotation in (Any, _EMPTY) or isinstance(annotation, str):
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        ranges = [m for m in annotation.__metadata__ if isinstance(m, Range)]
        return _fits(value, args[0]) and all(r.allows(value) for r in ranges)
    if origin in (Union, types.UnionType):
        return any(_fits(value, arm) for arm in args)
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if annotation is type(None) or annotation is None:
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args and (origin is not tuple or args[-1] is Ellipsis or len(args) == 1) else Any
        if origin is tuple and args and args[-1] is not Ellipsis and len(args) > 1:
            return len(value) == len(args) and all(map(_fits, value, args))
        return all(_fits(v, item) for v in value)
    if origin in (dict, Mapping) or annotation is dict:
        return isinstance(value, dict)
    # Objects built at run time (modules, factories, hooks): a config can only describe
    # them as a nested node, which is checked against its own _target_.
    return True


_PLURALS = {int: "ints", float: "numbers", str: "strings", bool: "booleans"}


def _plural(annotation: Any) -> str:
    """``ints >= 1`` for ``Annotated[int, Range(min=1)]``, for describing list items."""
    if typing.get_origin(annotation) is Annotated:
        ranges = [m.describe() for m in annotation.__metadata__ if isinstance(m, Range)]
        return " ".join([_plural(typing.get_args(annotation)[0]), *ranges])
    return _PLURALS.get(annotation) or f"items that are {describe(annotation)}"


_NAMES = {int: "an int", float: "a number", str: "a string", bool: "true or false",
          type(None): "null", None: "null"}


def describe(annotation: Any) -> str:
    """Plain words for what an annotation allows: ``an int >= 1``, ``one of: 'a', 'b'``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        ranges = [m.describe() for m in annotation.__metadata__ if isinstance(m, Range)]
        return " ".join([describe(args[0]), *ranges])
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(arm) for arm in args))
    if origin is Literal:
        return "one of: " + ", ".join(repr(a) for a in args)
    if origin is tuple and len(args) > 1 and args[-1] is not Ellipsis:
        return f"a list of {len(args)} " + (_plural(args[0]) if len(set(args)) == 1 else "items")
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin in (dict, Mapping) or annotation is dict:
        return "a mapping"
    return _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))
