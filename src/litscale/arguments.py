"""Checking arguments against their annotations, for a config and for a library caller alike.

Every ``_target_`` in ``conf/`` is a typed keyword-only constructor; its signature is the
schema. pydantic does the checking (``TypeAdapter``); this module only says what a config
means by a type, and words the result as one line a user can act on:

- scalars are strict: ``true`` is not an int, ``'1'`` is not an int, ``1`` is a fine float;
- a list and a tuple are the same thing (YAML has only lists);
- ``Literal[1, 2]`` takes the int 1, not ``True`` (pydantic compares by equality);
- ranges are ``annotated_types`` metadata (``Annotated[int, Ge(1)]``), see ``litscale.constraints``.

``checked_arguments("strategy")`` applies the same checks when a library user calls a
constructor, so constructors never re-check their own annotations by hand.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from types import UnionType
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic import (
    BeforeValidator,
    ConfigDict,
    PydanticSchemaGenerationError,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)

__all__ = ["check_value", "checked_arguments", "describe", "forwards_unknown_kwargs",
           "invalid_message", "signature_annotations"]

_EMPTY = inspect.Parameter.empty
_STRICT = {int: StrictInt, float: StrictFloat, str: StrictStr, bool: StrictBool}


# --- what an annotation means for a config value ------------------------------------------


def _exactly_one_of(choices: tuple) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not any(value == c and type(value) is type(c) for c in choices):
            raise ValueError("not one of the literal values with its own type")
        return value

    return check


def _as_config_type(annotation: Any) -> Any:
    """``annotation`` as pydantic should check a config value against it (see the module doc)."""
    if annotation in _STRICT:
        return _STRICT[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return Annotated[(_as_config_type(args[0]), *annotation.__metadata__)]
    if origin in (Union, UnionType):
        return Union[tuple(_as_config_type(arm) for arm in args)]  # noqa: UP007
    if origin is Literal:
        return Annotated[annotation, BeforeValidator(_exactly_one_of(args))]
    if origin in (list, Sequence) or (origin is tuple and args and args[-1] is Ellipsis):
        return list[_as_config_type(args[0])] if args else list
    if origin is tuple:
        return tuple[tuple(_as_config_type(arm) for arm in args)] if args else tuple
    if origin in (dict, Mapping):
        return dict[_as_config_type(args[0]), _as_config_type(args[1])] if args else dict
    if annotation is tuple:
        return list
    return annotation


@functools.lru_cache(maxsize=512)
def _adapter(annotation: Any) -> TypeAdapter | None:
    """The pydantic adapter for ``annotation``; None for what pydantic cannot describe (then
    any value passes: a config describes such objects as nested ``_target_`` nodes)."""
    try:
        return TypeAdapter(_as_config_type(annotation), config=ConfigDict(arbitrary_types_allowed=True))
    except (PydanticSchemaGenerationError, TypeError):
        return None


def check_value(value: Any, annotation: Any) -> str | None:
    """None when ``value`` fits ``annotation``, else what was expected, in words."""
    if annotation in (Any, _EMPTY) or isinstance(annotation, str):
        return None
    try:
        adapter = _adapter(annotation)
    except TypeError:  # an unhashable annotation: not cached
        adapter = _adapter.__wrapped__(annotation)
    if adapter is None:
        return None
    try:
        adapter.validate_python(value)
    except ValidationError:
        return describe(annotation)
    return None


# --- describing an annotation in words ----------------------------------------------------


_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="))


def _bounds(metadata: Sequence[Any]) -> list[str]:
    """``>= 1``, ``> 0 and <= 1``... for annotated_types metadata (an ``Interval`` unpacks)."""
    words = []
    for item in metadata:
        for bound in (item if isinstance(item, annotated_types.Interval) else [item]):
            for kind, attribute, symbol in _BOUNDS:
                if isinstance(bound, kind):
                    words.append(f"{symbol} {getattr(bound, attribute):g}")
    return words


def _with_bounds(words: str, metadata: Sequence[Any]) -> str:
    return " ".join([words, " and ".join(_bounds(metadata))]).strip()


_PLURALS = {int: "ints", float: "numbers", str: "strings", bool: "booleans"}
_NAMES = {int: "an int", float: "a number", str: "a string", bool: "true or false",
          type(None): "null", None: "null"}


def _plural(annotation: Any) -> str:
    """``ints >= 1`` for ``Annotated[int, Ge(1)]``, for describing list items."""
    if typing.get_origin(annotation) is Annotated:
        return _with_bounds(_plural(typing.get_args(annotation)[0]), annotation.__metadata__)
    return _PLURALS.get(annotation) or f"items that are {describe(annotation)}"


def describe(annotation: Any) -> str:
    """Plain words for what an annotation allows: ``an int >= 1``, ``one of: 'a', 'b'``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _with_bounds(describe(args[0]), annotation.__metadata__)
    if origin in (Union, UnionType):
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


def invalid_message(key: str, value: Any, expected: str) -> str:
    """The one line every invalid value gets: ``key=value is not valid: expected ...``."""
    shown = repr(value) if isinstance(value, str) else str(value)
    return f"{key}={shown} is not valid: expected {expected}"


# --- reading signatures -------------------------------------------------------------------


def _parameters(function: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}


def _resolved(function: Any, param: inspect.Parameter) -> Any:
    """One parameter's annotation, evaluated in its module (``from __future__ import
    annotations`` leaves strings). A name known only to type checkers stays unchecked (Any)."""
    annotation = param.annotation
    if annotation is _EMPTY:
        return Any
    if not isinstance(annotation, str):
        return annotation
    namespace = dict(getattr(inspect.unwrap(function), "__globals__", {}))
    try:
        return eval(annotation, namespace)  # noqa: S307 - annotations of our own signatures
    except Exception:  # noqa: BLE001 - NameError for TYPE_CHECKING-only names, and the like
        return Any


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
        for name, param in _parameters(function).items():
            if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                continue
            if name not in annotations:
                annotations[name] = _resolved(function, param)
    return annotations


def forwards_unknown_kwargs(target: Any) -> bool:
    """True when the last signature in the chain still takes ``**kwargs`` (anything goes)."""
    chain = _signature_chain(target)
    return bool(chain) and any(p.kind is p.VAR_KEYWORD for p in _parameters(chain[-1]).values())


# --- constructors -------------------------------------------------------------------------


def checked_arguments(group: str) -> Callable[[Callable], Callable]:
    """Check every argument a caller passes against its annotation, raising ``ValueError``
    with the same one line a config gets (``<group>.<name>=<value> is not valid: ...``).

    For constructors and factories that a config builds and a library user calls directly;
    the defaults are not checked (they are the author's)."""

    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            for name, value in bound.arguments.items():
                param = signature.parameters[name]
                if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                    continue
                problem = check_value(value, _resolved(function, param))
                if problem:
                    raise ValueError(invalid_message(f"{group}.{name}", value, problem))
            return function(*args, **kwargs)

        return checked

    return decorate
