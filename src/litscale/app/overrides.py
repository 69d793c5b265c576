"""A ``train.py`` command line's overrides, and Hydra's errors about them, as one line each.

Hydra reports a malformed override, a group set to null, a key it does not know or an empty
sweep in several lines (a traceback for some, a hint about ``HYDRA_FULL_ERROR`` for others),
and only after it has created the run dir. ``litscale.app.preflight`` calls these functions
before Hydra runs; each returns the line that says which override is wrong and what to type
instead (None when there is nothing to say).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from litscale.errors import ConfigError

# compose(overrides) -> the composed config, its ``hydra`` node included.
Compose = Callable[[list[str]], DictConfig]
# options(group) -> the option names of a config group (``[]``: not a group).
Options = Callable[[str], list[str]]

FORMS = "an override is key=value, +key=value adds a key, ~key deletes one"


def override_form_problem(overrides: list[str], *, multirun: bool) -> str | None:
    """The first override that is not of a form Hydra takes, or a ``-m`` sweep of no value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for text in overrides:
        key, equals, value = text.partition("=")
        name, deleting = key.lstrip("+~"), key.startswith("~")
        if not equals and not deleting:
            return f"{text} has no value: write {text}=<value>; {FORMS}"
        if not name:
            return f"{text} names no key: {FORMS}, e.g. trainer.devices{text}"
        if not value and not deleting:
            # NOTE: Hydra reads `key=` as the empty string; always a slip on a command line
            # (an empty string is `key=''`), and under -m a sweep of nothing.
            if multirun:
                return f"{text} sweeps no value: a sweep needs at least one value, e.g. -m {name}=<a>,<b>"
            return f"{text} has no value: write {name}=<value> ({name}='' for an empty string, {name}=null for none)"
        try:
            (parsed,) = parser.parse_overrides([text])
        except OverrideParseException as error:
            return f"cannot parse {text}: {_parse_hint(value, str(error))}"
        if multirun and parsed.is_discrete_sweep() and not list(parsed.sweep_string_iterator()):
            return f"{text} sweeps no value: a sweep needs at least one value, e.g. -m {name}=<a>,<b>"
    return None


def _parse_hint(value: str, hydra_message: str) -> str:
    if any(value.count(opening) != value.count(closing) for opening, closing in ("[]", "{}", "()")):
        return ("its brackets do not balance; a list is key=[a,b], a dict key={a:1}, and a value "
                "holding brackets or commas is quoted: key='...'")
    # Hydra's first line names the character; the grammar's token list after it does not help.
    first = (hydra_message.strip().splitlines() or ["not an override"])[0].split(" expecting ")[0]
    return (f"{first}; expected key=value (a list: key=[a,b]; with -m, a sweep: key=a,b; a value "
            "with special characters quoted: key='...')")


def null_group_problem(overrides: list[str], options: Options,
                       default_choices: Callable[[], dict]) -> str | None:
    """``group=null`` or ``~group``: Hydra takes a group's option by name only and fails on null
    with a traceback, and a run without its model (or any group it needs) fails in validation.
    ``default_choices()`` maps each group to its default option (None: the group is optional);
    called only for such an override, as it composes the default config (0.1 s)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(overrides):
        if override.value() is not None or (override.is_sweep_override() and not override.is_delete()):
            continue  # an option, or a sweep over options: Hydra checks those
        group = override.key_or_group
        choices = options(group)
        if not choices:
            continue  # a key, not a group: its null is the job's validation's to judge
        defaults = default_choices()
        optional = group in defaults and defaults[group] is None
        if override.is_delete() and optional:
            continue  # ~group of an optional group: as if never chosen
        text = f"~{group}" if override.is_delete() else f"{group}=null"
        leave = f" (or leave {group} out: it has none by default)" if optional else ""
        return f"{text}: the {group} group needs an option; choose one of: {', '.join(choices)}{leave}"
    return None


def explain_compose_error(error: Exception, overrides: list[str], *, compose: Compose,
                          options: Options) -> str:
    """Hydra's multi-line composition error about ``overrides`` (one job's) as one line."""
    text = str(error)
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    if missing:
        group, option = missing.groups()
        return f"{group}={option} is not an option; choose one of: {', '.join(options(group))}"
    present = re.search(r"Could not append to config. An item is already at '([^']+)'", text)
    if present:
        key = present.group(1)
        value = _value_of(overrides, key)
        return f"+{key}={value}: {key} is already in the config; set it without +: {key}={value}"
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if ambiguous:
        key, value = ambiguous.groups()
        return (f"{key}={value} is ambiguous: a list is {key}=[{value}], a string {key}='{value}', "
                f"and a sweep over its values needs -m (python train.py -m {key}={value})")
    chosen = re.search(r"Multiple values for (\S+?)\.", text)
    if chosen:
        group = chosen.group(1)
        value = _value_of(overrides, group)
        return f"+{group}={value}: {group} has an option already; pick another without +: {group}={value}"
    unknown = re.search(r"Could not override '([^']+)'", text) or re.search(
        r"Key '([^']+)' is not in struct[\s\S]*full_key: (\S+)", text)
    if unknown:
        return explain_unknown_key(unknown.groups()[-1], overrides, compose=compose, options=options)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return f"{first} (in: {' '.join(overrides)})"


def explain_unknown_key(key: str, overrides: list[str], *, compose: Compose, options: Options) -> str:
    """A key the config does not have: one its ``_target_`` takes (add it with ``+``), one of
    another option of its group (select that option), or a typo (the close and known keys)."""
    value = _value_of(overrides, key)
    try:  # the job's config (its own group choices: model=llama's keys, not the default's)
        cfg = compose([o for o in overrides if _key_of(o) != key])
    except Exception:  # noqa: BLE001 - another problem of the job; the defaults still help
        cfg = compose([])
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    arguments, target = _target_arguments(node, parent)
    if leaf in arguments:
        return f"{key} is not in the config yet; add it with +{key}={value}"
    group, owners = _options_having(key, options, compose)
    if owners:
        selected = cfg.hydra.runtime.choices.get(group)
        named = " or ".join(f"{group}={option}" for option in owners)
        return (f"{key} belongs to {named}, not the selected {group}={selected}; select one, e.g. "
                f"{group}={owners[0]} {key}={value}")
    siblings = sorted(str(k) for k in node if not str(k).startswith("_") and (parent or k != "hydra")
                      ) if isinstance(node, DictConfig) else []
    addable = sorted(arguments - set(siblings))
    close = difflib.get_close_matches(leaf, siblings + addable, n=1)
    where = f"{parent}." if parent else ""
    hint = "" if not close else (f"did you mean {where}{close[0]}? " if close[0] in siblings
                                 else f"did you mean +{where}{close[0]}={value}? ")
    message = f"{key} is not a known key; {hint}{parent or 'the config'} has: {', '.join(siblings)}"
    if addable:
        more = f"one of: {', '.join(addable)}" if len(addable) <= 8 else f"another argument of {target}"
        message += f"; +{where}<key>=<value> adds {more}"
    return message


def _key_of(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _value_of(overrides: list[str], key: str) -> str:
    return next((o.partition("=")[2] for o in overrides if _key_of(o) == key), "...")


def _target_arguments(node, path: str) -> tuple[set[str], str | None]:
    """The arguments of the ``_target_`` that ``node`` builds (empty when it builds none)."""
    from litscale.app.checks.safety import locate_target
    from litscale.arguments import signature_annotations

    if not isinstance(node, DictConfig) or "_target_" not in node:
        return set(), None
    try:
        return set(signature_annotations(locate_target(node["_target_"], path))), node["_target_"]
    except ConfigError:
        return set(), None


def _options_having(key: str, options: Options, compose: Compose) -> tuple[str, list[str]]:
    """The config group ``key`` is under (its longest dotted prefix that is a group) and the
    options of that group whose config has ``key``: ``strategy.tensor_parallel_size`` is
    strategy=pipeline's and strategy=tensor_parallel's."""
    parts = key.split(".")
    for length in range(len(parts) - 1, 0, -1):
        group = "/".join(parts[:length])
        names = [] if group.startswith("hydra") else options(group)
        if names:
            break
    else:
        return "", []
    parent, _, leaf = key.rpartition(".")
    inside = parent[len(group):]  # the key's place under the group's node
    try:  # every option in one composition, option o at `litscale_options.o` (`+group@package=o`)
        every = compose([f"+{group}@litscale_options.{option}={option}" for option in names])
        nodes = {option: OmegaConf.select(every, f"litscale_options.{option}{inside}") for option in names}
    except Exception:  # noqa: BLE001 - an option that does not compose: none is named
        return group, []
    return group, [option for option, node in nodes.items() if isinstance(node, DictConfig) and leaf in node]
