"""The tables of options in ``README.md`` and ``docs/index.md`` against what they describe: each
config group's options are its files under ``conf/``, and the extras are pyproject.toml's.
A group, an option or an extra added without its line in the tables fails here, as does a
name the tables spell differently from the code (``kubernetes`` for the ``k8s`` extra)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from helpers.configs import REPO_ROOT

CONF = REPO_ROOT / "conf"
README = REPO_ROOT / "README.md"
INDEX = REPO_ROOT / "docs" / "index.md"
DOCS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]

# Folders of conf/ that are not a choice on the command line.
NOT_CHOICES = {
    "hydra": "Hydra's own settings (its launcher/ and sweeper/ folders are groups)",
    "paths": "where outputs go: one option, moved by LITSCALE_OUTPUTS",
    "model/callbacks": "the callback model=moe brings with it",
}
# Options Hydra itself registers (its ConfigStore), not files of conf/.
HYDRA_OWN = {"hydra/launcher": {"basic"}, "hydra/sweeper": {"basic"}}
# A README row may leave out the option that turns its group off.
OFF = {"none"}


def conf_groups() -> dict[str, set[str]]:
    """Group (``strategy``, ``hydra/launcher``) -> its options, from the files under conf/."""
    groups: dict[str, set[str]] = {}
    for file in CONF.rglob("*.yaml"):
        group = file.parent.relative_to(CONF).as_posix()
        if group != "." and group not in NOT_CHOICES:
            groups.setdefault(group, set()).add(file.stem)
    return groups


def top_level_keys(group: str) -> set[str]:
    """The keys of a top-level mapping of conf/train.yaml (``scaling``, ``launcher``)."""
    return set(yaml.safe_load((CONF / "train.yaml").read_text())[group])


def extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def requirement_names(requirement: str) -> set[str]:
    """``ray[train]>=2.60,<3`` -> ``ray``; ``litscale[ray,k8s]`` (other extras) -> ``ray``, ``k8s``."""
    if requirement.startswith("litscale["):
        return set(requirement[len("litscale["):-1].split(","))
    return {re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)}


def table(path: Path, heading: str) -> list[list[str]]:
    """The rows (cells, stripped) of the first table under ``heading``, header row left out."""
    lines = path.read_text().splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not re.match(r"^\|\s*-", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows and not line.startswith("|"):
            break
    assert rows, f"no table under {heading!r} in {path.name}"
    return rows[1:]


def named(cell: str) -> set[str]:
    """The names a cell lists in backticks, less what it says of them in parentheses."""
    while re.search(r"\([^()]*\)", cell):
        cell = re.sub(r"\([^()]*\)", "", cell)
    return set(re.findall(r"`([\w-]+)`", cell))  # names only: not `model.net.preset=...`


def overrides(cell: str) -> list[tuple[str, str]]:
    """``(group, option)`` for each ``group=option`` a cell shows (``a,b`` of a sweep split)."""
    found = re.findall(r"(?:^|[\s`+])([a-z_]+(?:/[a-z_]+)?)=([A-Za-z0-9_,]+)", cell)
    return [(group, option) for group, options in found for option in options.split(",")]


def hydra_registered(group: str) -> set[str]:
    """Those of ``HYDRA_OWN[group]`` that Hydra really registers."""
    if group not in HYDRA_OWN:
        return set()
    # Importing Hydra's core plugins registers their options, as its plugin scan does.
    import hydra._internal.core_plugins.basic_launcher  # noqa: F401
    import hydra._internal.core_plugins.basic_sweeper  # noqa: F401
    from hydra.core.config_store import ConfigStore

    return {name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)} & HYDRA_OWN[group]


# --- docs/index.md: every group and its options ---------------------------------------------


def index_groups() -> dict[str, tuple[set[str], bool]]:
    """Group -> (the options its row lists, whether the row lists keys of train.yaml)."""
    rows = table(INDEX, "## Config groups")
    return {re.match(r"`([^`]+)`", group).group(1): (named(options), "(keys)" in group)
            for group, options, *_ in rows}


def test_the_index_lists_every_config_group():
    listed = {group for group, (_, keys) in index_groups().items() if not keys}
    assert sorted(listed) == sorted(conf_groups())


@pytest.mark.parametrize("group", sorted(conf_groups()))
def test_the_index_lists_each_groups_options_as_conf_has_them(group):
    options, _ = index_groups()[group]
    assert sorted(options - hydra_registered(group)) == sorted(conf_groups()[group])


def test_the_index_rows_of_keys_list_the_keys_of_train_yaml():
    for group, (keys, is_keys) in index_groups().items():
        if is_keys:
            assert keys == top_level_keys(group), group


# --- the README: the overrides used most ----------------------------------------------------


def test_the_readmes_overrides_list_every_option_of_their_group():
    groups = conf_groups()
    for override, what, *_ in table(README, "## The overrides used most"):
        pairs = [(group, option) for group, option in overrides(override) if group in groups]
        if len(pairs) != 1:
            continue  # a key (trainer.devices=2) or a sweep, not one group's option
        group, option = pairs[0]
        assert option in groups[group], override
        listed = named(what)
        if listed:  # a row that names none is about its own option only
            assert listed <= groups[group], (override, sorted(listed - groups[group]))
            assert groups[group] - listed <= OFF, (override, sorted(groups[group] - listed))


@pytest.mark.parametrize("path", [README, INDEX], ids=lambda path: path.name)
def test_every_group_option_a_table_shows_exists(path):
    groups = conf_groups()
    text = "\n".join(line for line in path.read_text().splitlines() if line.startswith("|"))
    unknown = [f"{group}={option}" for group, option in overrides(text) if group in groups
               and option not in groups[group] | hydra_registered(group)]
    assert unknown == []


# --- extras: pyproject.toml's -----------------------------------------------------------------


def test_the_index_lists_every_extra_and_what_it_installs():
    rows = {re.fullmatch(r"`([^`]+)`", extra).group(1): named(installs)
            for extra, installs, *_ in table(INDEX, "## Optional extras")}
    assert sorted(rows) == sorted(extras())
    for extra, requirements in extras().items():
        assert rows[extra] == {name for r in requirements for name in requirement_names(r)}, extra


EXTRA_MENTIONS = (
    r"(?:\.|litscale)\[([\w-]+)\]",  # pip install -e '.[ray]', litscale[hf]
    r"the `([\w-]+)` extra\b",  # "needs the `hf` extra"
)


def extras_named(text: str) -> set[str]:
    """The extras a page names by their install spelling, or in ``\\`a\\`, \\`b\\` and \\`c\\` are
    optional extras``."""
    names = {name for pattern in EXTRA_MENTIONS for name in re.findall(pattern, text)}
    for listing in re.findall(r"((?:`[\w-]+`(?:,\s*|\s+and\s+)?)+)\s+are\s+(?:optional\s+)?extras", text):
        names |= set(re.findall(r"`([\w-]+)`", listing))
    return names


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_the_extras_a_page_names_exist(path):
    assert sorted(extras_named(path.read_text()) - set(extras())) == []


def test_the_extras_reader_sees_each_spelling():
    text = "`ray`, `kubernetes`\nand `optuna` are optional extras (`pip install -e '.[ray]'`); the `hf` extra"
    assert extras_named(text) == {"ray", "kubernetes", "optuna", "hf"}
