"""Checking a ``train.py`` command line before Hydra creates a run dir or any rank starts.

Hydra reports composition problems (an unknown option, an unknown key) in several lines
with hints, and only after it has created the run directory. This module composes every
job the command line describes (each combination of a ``-m`` sweep), turns Hydra's errors
into one line naming the key, the bad value and what is allowed (``litscale.app.overrides``),
and runs the same validation as the job itself. On a problem it prints ``error: <line>`` and
exits 2 with nothing written. A device sweep's cell that cannot run while the rest of its
row and column can (``strategy=single`` at 2 devices) is skipped instead, with one line.
"""

from __future__ import annotations

import functools
import json
import os
import sys

from omegaconf import OmegaConf

from litscale.errors import ConfigError

MAX_JOBS_CHECKED = 256
EXIT_BAD_CONFIG = 2


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_CONFIG)


def job_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of each job: one job, or every combination of a sweep."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    if not multirun:
        return [overrides]
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [job for batch in batches for job in batch][:MAX_JOBS_CHECKED]


def check_command_line(argv: list[str], *, config_dir: str, config_name: str) -> list[list[str]]:
    """Validate every job of a ``train.py`` command line; exit 2 with one line on a problem.

    Returns the jobs of a device sweep to leave out (``cells_to_skip``), each named in a
    printed line; ``train.py`` hands them to the sweeper (``SKIPPED_JOBS_ENV``)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from litscale.app.checks.extras import missing_option_package
    from litscale.app.overrides import (
        explain_compose_error,
        null_group_problem,
        override_form_problem,
    )

    args = get_args_parser().parse_args(argv)
    modes = [flag for flag, given in (("-m", args.multirun), ("--run", args.run), ("--cfg", args.cfg),
                                      ("--info", args.info), ("--shell-completion", args.shell_completion))
             if given]
    if len(modes) > 1:  # Hydra says so in a traceback
        fail(f"{' and '.join(modes)} cannot be given together: use one of them at a time")
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return []  # Hydra's own informational modes: nothing runs
    if args.config_path:
        return []  # another primary config: left to Hydra and the job's own validation
    config_name = args.config_name or config_name
    # --config-dir adds a folder of configs (plan=auto's experiments): searched first, as Hydra does
    searched = [f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]"] if args.config_dir else []
    problem = override_form_problem(args.overrides, multirun=args.multirun)
    if problem:
        fail(problem)
    jobs = job_overrides(args.overrides, args.multirun)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()

        def options(group: str) -> list[str]:
            extra = _folder_options(args.config_dir, group) if args.config_dir else []
            return sorted({*loader.get_group_options(group), *extra})

        def compose_job(overrides: list[str]):
            return compose(config_name, overrides=searched + overrides, return_hydra_config=True)

        @functools.cache
        def default_choices() -> dict:
            return dict(compose_job([]).hydra.runtime.choices)

        failed: dict[int, str] = {}
        for index, overrides in enumerate(jobs):
            problem = null_group_problem(overrides, options, default_choices)
            if problem:
                fail(problem)
            try:
                cfg = compose_job(overrides)
            except (HydraException, ValueError) as error:  # Hydra raises ValueError for some
                fail(missing_option_package(overrides, config_dir)
                     or explain_compose_error(error, overrides, compose=compose_job, options=options))
            try:
                validate_job(cfg, multirun=args.multirun)
            except ConfigError as error:
                if not args.multirun:
                    fail(str(error))
                failed[index] = str(error)
    GlobalHydra.instance().clear()
    skipped = cells_to_skip(jobs, failed)
    refused = [index for index in failed if index not in skipped]
    if refused:
        fail(failed[refused[0]])
    for index in skipped:
        print(f"litscale: skipping {_cell(jobs, index)}: {failed[index]}", flush=True)
    return [jobs[index] for index in skipped]


def validate_job(cfg, *, multirun: bool) -> None:
    """Validate one composed job (its ``hydra`` node included) as the job itself will."""
    from litscale.app.checks.extras import check_sweep_extras
    from litscale.app.checks.validation import only_planned, planning, validate
    from litscale.app.launch import check_launchable

    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if isinstance(v, str)}
    if multirun:  # Hydra builds the launcher and the sweeper only for a sweep
        check_sweep_extras(cfg, choices)
    on_cluster = multirun and runs_jobs_elsewhere(cfg)
    elastic = on_cluster and check_cluster_resources(cfg)
    job = as_job_config(cfg)
    if elastic:  # as the launcher hands the job to its ranks (the Ray and k8s launchers' elastic=true)
        job.elastic = True
    here = not on_cluster and not only_planned(job)
    layout = validate(job, choices=choices, this_machine=here)
    if here:  # the ranks can start from this process
        check_launchable(layout.processes_per_node, layout.num_nodes)
    if (job.get("preflight") or {}).get("collectives") and not planning(job):  # plan=show traces them itself
        from litscale.app.checks.collectives import check_collectives

        print(f"litscale: {check_collectives(job, choices.get('strategy', ''), layout)}", flush=True)


def _cell(jobs: list[list[str]], index: int) -> str:
    """A job of a sweep named by the overrides the sweep varies (its cell of the grid)."""
    def values(key: str) -> set[str]:
        return {o for job in jobs for o in job if o.partition("=")[0] == key}

    return " ".join(o for o in jobs[index] if len(values(o.partition("=")[0])) > 1)


def _folder_options(config_dir: str, group: str) -> list[str]:
    folder = os.path.join(config_dir, group)
    return [f[:-5] for f in os.listdir(folder) if f.endswith(".yaml")] if os.path.isdir(folder) else []


# Read by litscale's sweeper (hydra/sweeper=litscale): the jobs train.py leaves out.
SKIPPED_JOBS_ENV = "LITSCALE_SKIPPED_JOBS"


def skip_jobs(jobs: list[list[str]]) -> None:
    """Have this process's sweep leave ``jobs`` out (``check_command_line`` returned them)."""
    if jobs:
        os.environ[SKIPPED_JOBS_ENV] = json.dumps(jobs)


def cells_to_skip(jobs: list[list[str]], failed: dict[int, str]) -> list[int]:
    """The failed jobs of a sweep over device counts that are only a combination that cannot
    run, as ``strategy=single`` at 2 devices in ``trainer.devices=1,2 strategy=single,ddp``:
    some job runs at its device count, and some job runs its other overrides at another count.
    A scaling study runs the rest. A job failing where neither holds (every job at that
    device count, or every count of that strategy) is a mistake in the sweep, and not skipped."""
    from litscale.app.scaling_study import DEVICE_KEYS

    def cell(job: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        devices = tuple(sorted(o for o in job if o.partition("=")[0].lstrip("+") in DEVICE_KEYS))
        return devices, tuple(sorted(o for o in job if o not in devices))

    cells = [cell(job) for job in jobs]
    if len({devices for devices, _ in cells}) < 2:
        return []  # no device count swept
    ran = [cells[index] for index in range(len(jobs)) if index not in failed]
    return [index for index in sorted(failed)
            if any(devices == cells[index][0] for devices, _ in ran)
            and any(rest == cells[index][1] for _, rest in ran)]


# Launchers of other packages that run each job on other machines (they cannot say so
# themselves; litscale's own say it, ``runs_jobs_elsewhere``).
OTHER_PACKAGES_CLUSTER_LAUNCHERS = ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",)


def launcher_class(cfg) -> type | None:
    """The class ``hydra.launcher._target_`` names (None: Hydra's default launcher)."""
    from litscale.app.checks.safety import locate_target

    target = OmegaConf.select(cfg, "hydra.launcher._target_")
    return locate_target(str(target), "hydra.launcher") if target else None


def runs_jobs_elsewhere(cfg) -> bool:
    """Whether the sweep's launcher runs each job on other machines, whose devices are not this
    machine's: its class says so (``runs_jobs_elsewhere``)."""
    if OmegaConf.select(cfg, "hydra.launcher._target_") in OTHER_PACKAGES_CLUSTER_LAUNCHERS:
        return True
    return bool(getattr(launcher_class(cfg), "runs_jobs_elsewhere", False))


def check_cluster_resources(cfg) -> bool:
    """A launcher that runs jobs elsewhere answers for one job itself (its ``check_job``:
    litscale's size each job from ``trainer.devices`` and ``trainer.num_nodes``): the
    launcher settings must resolve, and the launcher must accept them. True where they make the
    job elastic (its rank count then changes on its own)."""
    try:
        params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    except Exception as error:  # noqa: BLE001 - OmegaConf's several error types, one message
        raise ConfigError(f"hydra.launcher: {str(error).splitlines()[0]}") from None
    own = OmegaConf.select(cfg, "hydra.launcher._target_") not in OTHER_PACKAGES_CLUSTER_LAUNCHERS
    check_job = getattr(launcher_class(cfg), "check_job", None) if own else None
    if check_job is None:
        return False
    return bool(check_job(params, devices=cfg.trainer.get("devices"),
                          strategy_target=str(OmegaConf.select(cfg, "strategy._target_") or "")))


def as_job_config(cfg):
    """The composed config as the job will see it: no ``hydra`` node, and a placeholder for
    the run dir, which is not known before Hydra creates it."""
    from omegaconf import open_dict

    with open_dict(cfg):
        del cfg["hydra"]
        cfg.paths.output_dir = os.path.join(str(cfg.paths.root_dir), "<run dir>")
    return cfg
