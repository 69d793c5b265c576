"""The README and the docs site (``docs/``, ``mkdocs.yml``): the site builds with
``mkdocs build --strict``, the README stays short and links every page, and every command the
pages mark runnable runs as shown.

A fenced block is runnable when the last non-blank line before it is an HTML comment,
``<!-- runnable -->`` or ``<!-- runnable: FLAGS -->`` (invisible on GitHub and in the site).
FLAGS, separated by spaces:

- ``full``: ``make test-full`` runs it, ``make test`` leaves it out (``make test`` runs only the
  ``error`` commands; of those that train, ``make test-full`` runs the README's and ``make
  test-soak`` the other pages');
- ``soak``: longer still (several ranks or runs): only ``make test-soak`` runs it, beyond CI's time;
- ``error``: each command must fail before anything starts, with exit code 2 and one line of
  output, the ``# error: ...`` comment written under it;
- ``after-run``: a Python block that reads a run's outputs; it runs after a short default run,
  with ``outputs/default/runs/<run>`` standing for that run's directory;
- ``together``: the page's blocks so marked (``bash`` and ``python``) are one example whose
  steps use what the ones before wrote: they run in page order, as written (not made short),
  one test, in a working directory of their own that holds the repository's ``train.py``,
  ``conf/`` and ``docs/`` (links), its runs under its ``outputs/``.

A ``bash`` block holds one command per line (a trailing ``\\`` continues it, ``#`` starts a
comment, ``NAME=value`` words before the program set its environment); each command is its
own test, and a command shown on several pages is run once. Commands that run ``train.py``
run short: ``trainer.max_steps=2 trainer.limit_val_batches=2`` are added unless the command
sets them. A ``python`` block is run as a script.

The runs share one data cache, as a user's runs do (the byte corpus is built by the first
run, not by each), and an ``after-run`` block reads the same short default run as the
README's first command when both are selected.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from helpers.cli import REPO, cli_env, explain, run_in_own_group, run_train, summaries
from helpers.fork_server import ForkServer

README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 250
SHORT_RUN = {"trainer.max_steps": "2", "trainer.limit_val_batches": "2"}
RUN_PLACEHOLDER = "outputs/default/runs/<run>"
MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<flags>[^>]*?))?\s*-->$")
FLAGS = {"full", "soak", "error", "after-run", "together"}


@dataclass
class Runnable:
    """One command of a runnable ``bash`` block, or one runnable ``python`` block."""

    page: str
    line: int
    language: str
    flags: set[str]
    text: str  # the command (bash) or the script (python)
    expected_error: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    steps: list[Runnable] = field(default_factory=list)  # a ``together`` example's, in order

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def markdown_pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def fenced_blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """``(line of the first body line, language, body, marker flags or None)`` for each fenced
    block of a Markdown file."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = re.match(r"^```(\S*)", lines[index])
        if not opening:
            index += 1
            continue
        before = next((lines[k].strip() for k in range(index - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(before)
        end = next(k for k in range(index + 1, len(lines)) if lines[k].startswith("```"))
        body = "\n".join(lines[index + 1:end])
        blocks.append((index + 2, opening.group(1), body, (marker.group("flags") or "") if marker else None))
        index = end + 1
    return blocks


def bash_commands(body: str, first_line: int) -> list[tuple[int, str, str | None]]:
    """``(line, command, the '# error: ...' comment under it or None)`` for each command."""
    commands: list[list] = []
    pending, start = "", first_line
    for number, raw in enumerate(body.splitlines(), first_line):
        line = raw.rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        stripped = line.strip()
        if stripped.startswith("# error:") and commands:
            commands[-1][2] = stripped[2:]
        elif stripped and not stripped.startswith("#"):
            commands.append([start, stripped, None])
    return [tuple(command) for command in commands]


def collect_runnables() -> list[Runnable]:
    """Every runnable command and script of the README and the docs, each command once; a
    page's ``together`` blocks as one ``example`` whose ``steps`` they are."""
    found, seen = [], set()
    for path in markdown_pages():
        page = str(path.relative_to(REPO))
        example = None
        for first_line, language, body, flags in fenced_blocks(path):
            if flags is None:
                continue
            flag_set = set(flags.split())
            if "together" in flag_set:
                if example is None:
                    example = Runnable(page, first_line, "example", flag_set - {"together"}, "")
                    found.append(example)
                example.steps.extend(block_runnables(page, first_line, language, body, flag_set))
                continue
            for runnable in block_runnables(page, first_line, language, body, flag_set):
                key = " ".join(runnable.argv)
                if language == "bash" and key in seen:
                    continue
                seen.add(key)
                found.append(runnable)
    return found


def block_runnables(page: str, first_line: int, language: str, body: str, flags: set[str]) -> list[Runnable]:
    """A ``python`` block as one runnable, a ``bash`` block's commands one each."""
    if language == "python":
        return [Runnable(page, first_line, language, flags, body)]
    found = []
    for line, command, expected in bash_commands(body, first_line):
        words = shlex.split(command, comments=True)
        env = {}
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        found.append(Runnable(page, line, language, flags, command, expected, env, words))
    return found


RUNNABLES = collect_runnables()


def _param(runnable: Runnable):
    # make test runs the commands a page shows refused (one line each, before anything starts);
    # of those that train, make test-full runs the README's and make test-soak the pages' (CI's
    # 30 minutes on 2 cores hold the README's first steps, not every page's runs: tests/README.md).
    flags = set(runnable.flags)
    if "error" not in flags:
        flags.add("full" if runnable.page == "README.md" else "soak")
    marks = [getattr(pytest.mark, flag) for flag in ("full", "soak") if flag in flags]
    return pytest.param(runnable, id=runnable.id, marks=marks)


def short_run(argv: list[str]) -> list[str]:
    """``argv`` with the overrides of a short run added where it runs ``train.py`` and does not
    set them itself."""
    if "train.py" not in argv:
        return argv
    given = {word.split("=", 1)[0] for word in argv if "=" in word}
    return argv + [f"{key}={value}" for key, value in SHORT_RUN.items() if key not in given]


def command_argv(runnable: Runnable) -> list[str]:
    """What is run for a ``bash`` command: an error as written, a run made short."""
    return runnable.argv if "error" in runnable.flags else short_run(runnable.argv)


def run_command(runnable: Runnable, outputs: Path, *, env: dict | None = None,
                timeout: float = 500) -> subprocess.CompletedProcess:
    """Run a ``bash`` command from the repo root as a user would, outputs under ``outputs``,
    with ``env`` added to the command's own environment."""
    argv, env = command_argv(runnable), {**(env or {}), **runnable.env}
    if argv[:2] == ["python", "train.py"]:
        return run_train(*argv[2:], outputs=outputs, timeout=timeout, env=env)
    program = sys.executable if argv[0] == "python" else str(Path(sys.executable).parent / argv[0])
    process, _, _ = run_in_own_group([program, *argv[1:]], outputs=outputs, env=env, timeout=timeout)
    return process


# The short default run an ``after-run`` block reads: the README's first command, made short.
DEFAULT_RUN = Runnable("README.md", 0, "bash", set(), "python train.py", argv=["python", "train.py"])


class Runs:
    """Each distinct command run once, with outputs of its own under ``root`` and the data
    cache ``cache`` shared by all. A ``train.py`` command shown refused runs in a fork server
    (``helpers/fork_server.py``: it ends before any rank starts, and a fresh interpreter's
    imports cost ten times the refusal); ``test_validation.py`` runs refusals both ways."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root, self.cache = root, cache
        self.done: dict[tuple, tuple[Path, subprocess.CompletedProcess]] = {}
        self.server: ForkServer | None = None

    def get(self, runnable: Runnable) -> tuple[Path, subprocess.CompletedProcess]:
        """The outputs directory and the process of ``runnable``'s command."""
        key = (tuple(command_argv(runnable)), tuple(sorted(runnable.env.items())))
        if key not in self.done:
            outputs = Path(tempfile.mkdtemp(dir=self.root))
            env = {"LITSCALE_CACHE": str(self.cache)}
            # (not with an environment of its own: the server's PYTHONPATH is fixed at its start)
            if "error" in runnable.flags and runnable.argv[:2] == ["python", "train.py"] and not runnable.env:
                self.done[key] = outputs, self.refused(runnable, outputs, env)
            else:
                self.done[key] = outputs, run_command(runnable, outputs, env=env)
        return self.done[key]

    def refused(self, runnable: Runnable, outputs: Path, env: dict) -> subprocess.CompletedProcess:
        if self.server is None:
            self.server = ForkServer(cli_env(self.root))
        code, out, err = self.server.run(runnable.argv[2:], Path(tempfile.mkdtemp(dir=self.root)),
                                         {"LITSCALE_OUTPUTS": str(outputs), **env, **runnable.env})
        return subprocess.CompletedProcess(runnable.argv, code, out, err)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = Runs(tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("cache"))
    yield runs
    runs.close()


def run_script(code: str, directory: Path, outputs: Path, *, timeout: float = 500) -> subprocess.CompletedProcess:
    script = directory / "snippet.py"
    script.write_text(code)
    process, _, _ = run_in_own_group([sys.executable, str(script)], outputs=outputs, timeout=timeout)
    return process


# --- the site and the README ------------------------------------------------------------------


def nav_pages() -> list[str]:
    """The pages ``mkdocs.yml``'s nav lists, in order."""
    def walk(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in walk(item)]
        return [page for value in node.values() for page in walk(value)]

    return walk(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])


def readme_links() -> list[str]:
    """Relative link targets of the README, anchors dropped."""
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    return [target.split("#")[0] for target in targets if not re.match(r"^[a-z]+:", target)]


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; keep it to {MAX_README_LINES}"


def test_every_docs_page_is_in_the_nav_and_linked_from_the_readme():
    pages = sorted(path.name for path in DOCS.glob("*.md"))
    assert sorted(nav_pages()) == pages
    linked = {target.removeprefix("docs/") for target in readme_links() if target.startswith("docs/")}
    assert sorted(linked) == pages


def test_readme_links_resolve():
    missing = [target for target in readme_links() if target and not (REPO / target).exists()]
    assert missing == []


# --- what the code cites, and the environment the commands run in ----------------------------

DOC_CITATION = re.compile(r"docs/[\w./-]+\.md(?:#[\w-]+)?")


def cited_docs() -> list[tuple[str, str]]:
    """``(file, citation)`` for each docs page (with its anchor) a config or source file names."""
    files = sorted([*(REPO / "conf").rglob("*.yaml"), *(REPO / "src").rglob("*.py")])
    return sorted({(str(file.relative_to(REPO)), citation) for file in files
                   for citation in DOC_CITATION.findall(file.read_text())})


def heading_anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives the page's headings (Python-Markdown's toc slugify)."""
    from markdown.extensions.toc import slugify

    headings = re.findall(r"^#+\s+(.*)$", page.read_text(), re.MULTILINE)
    return {slugify(heading.replace("`", ""), "-") for heading in headings}


@pytest.mark.parametrize(("file", "citation"), [pytest.param(*cited, id=":".join(cited)) for cited in cited_docs()])
def test_a_docs_page_the_code_cites_exists(file, citation):
    page, _, anchor = citation.partition("#")
    assert (REPO / page).is_file(), f"{file} cites {citation}, which does not exist"
    if anchor:
        assert anchor in heading_anchors(REPO / page), f"{file} cites {citation}: no such heading"


def test_the_citation_reader_sees_pages_and_anchors():
    assert DOC_CITATION.findall("see docs/reliability.md#bit-identical-layouts, and (docs/llm.md).") == [
        "docs/reliability.md#bit-identical-layouts", "docs/llm.md"]


def bash_lines(page: Path) -> list[str]:
    """The lines of the page's bash blocks, in order."""
    return [line.strip() for _, language, body, _ in fenced_blocks(page) if language == "bash"
            for line in body.splitlines() if line.strip()]


@pytest.mark.parametrize("page", [README, DOCS / "index.md"], ids=lambda page: page.name)
def test_the_commands_run_in_the_environment_make_train_created(page):
    """A new shell has no Hydra on its ``python``: the environment ``make train`` creates is
    activated (or its python called) before the first command that needs it."""
    venv = re.search(r"^VENV := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
    commands = bash_lines(page)
    first = next(n for n, command in enumerate(commands) if re.match(r"^(python|pytest|mkdocs)\b", command))
    activated = [command for command in commands[:first] if command == f"source {venv}/bin/activate"]
    assert activated, f"{page.name}: `{commands[first]}` comes before `source {venv}/bin/activate`"


def test_runnable_blocks_are_well_formed():
    assert RUNNABLES, "no runnable block found"
    for runnable in RUNNABLES:
        assert runnable.flags <= FLAGS, f"{runnable.id}: unknown flags {runnable.flags - FLAGS}"
        assert runnable.language in ("bash", "python", "example"), f"{runnable.id}: a {runnable.language} block"
        if runnable.language == "example":
            assert runnable.steps and all(step.language in ("bash", "python") for step in runnable.steps), runnable.id
        if "error" in runnable.flags:
            assert runnable.expected_error, f"{runnable.id}: an error command needs '# error: ...' under it"
        if "after-run" in runnable.flags:
            assert RUN_PLACEHOLDER in runnable.text, f"{runnable.id}: after-run without {RUN_PLACEHOLDER}"


def test_the_collector_reads_commands_comments_and_continuations():
    body = "A=1 python train.py x=1 \\\n  y=2   # a comment\n# error: bad\n\npython train.py z=3"
    assert bash_commands(body, 10) == [(10, "A=1 python train.py x=1    y=2   # a comment", "error: bad"),
                                       (14, "python train.py z=3", None)]
    assert short_run(["python", "train.py", "trainer.max_steps=5"]) == [
        "python", "train.py", "trainer.max_steps=5", "trainer.limit_val_batches=2"]


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    """A broken link or anchor, or a page missing from the nav, fails the build."""
    process = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert process.returncode == 0, explain(process)
    assert (tmp_path / "site" / "add-your-own-model" / "index.html").exists()


# --- the runnable commands ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("runnable", [_param(r) for r in RUNNABLES if r.language == "bash"])
def test_runnable_command(runnable, runs):
    outputs, process = runs.get(runnable)
    if "error" in runnable.flags:
        shown = [line for line in (process.stdout + process.stderr).splitlines() if line.strip()]
        assert (process.returncode, shown) == (2, [runnable.expected_error]), explain(process)
        return
    assert process.returncode == 0, explain(process)
    if "train.py" in runnable.argv and not any(word.startswith("plan=") for word in runnable.argv):
        assert summaries(outputs), f"no summary.json under {outputs}\n{explain(process)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("runnable", [_param(r) for r in RUNNABLES if r.language == "python"])
def test_runnable_script(runnable, runs, outputs_root, tmp_path):
    code = runnable.text
    if "after-run" in runnable.flags:
        outputs, run = runs.get(DEFAULT_RUN)
        assert run.returncode == 0, explain(run)
        code = code.replace(RUN_PLACEHOLDER, summaries(outputs)[-1]["output_dir"])
    process = run_script(code, tmp_path, outputs_root)
    assert process.returncode == 0, explain(process)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("runnable", [_param(r) for r in RUNNABLES if r.language == "example"])
def test_runnable_example(runnable, tmp_path):
    """A ``together`` example's steps in page order, in a working directory of their own: a user
    at the repository's root, whose ``outputs/`` is this directory's."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("train.py", "conf", "docs"):
        (work / name).symlink_to(REPO / name)
    cache = {"LITSCALE_CACHE": str(tmp_path / "cache")}
    for step in runnable.steps:
        if step.language == "python":
            (work / "snippet.py").write_text(step.text)
            argv = [sys.executable, "snippet.py"]
        else:
            program = step.argv[0]
            argv = [sys.executable if program == "python" else program, *step.argv[1:]]
        process, _, _ = run_in_own_group(argv, outputs=work / "outputs", env={**cache, **step.env}, timeout=900,
                                         cwd=work)
        assert process.returncode == 0, f"{step.id}: {step.text}\n{explain(process)}"
