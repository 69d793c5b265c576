"""The held-out accuracy study (``experiments/planner/held_out.py``): a seeded draw of
configurations the cost model was not developed on, at a model shape no test uses, at least 8 per
group; MAPE and Spearman with bootstrap intervals checked against scipy's; and ``plan=auto``
taking the planner's pick only where the interval's lower end clears the bar."""

from __future__ import annotations

import importlib.util
import re
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLANNER = REPO / "experiments" / "planner"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, PLANNER / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# experiments/planner/study.py under a name of its own (other experiments have a study.py too);
# it puts its folder on the path for its held_out.py
study = _load("planner_study", "study.py")
import held_out  # noqa: E402

DATA_RANKS = {layout: ranks for layouts in held_out.LAYOUTS.values() for layout, _, ranks, _ in layouts}


def test_the_draw_is_seeded_and_holds_8_configurations_per_group_none_developed_on():
    drawn = held_out.draw(study.CONFIGS, seed=0)
    assert drawn == held_out.draw(study.CONFIGS, seed=0) != held_out.draw(study.CONFIGS, seed=1)
    developed = held_out.developed_on(study.CONFIGS)
    for model, group in study.GROUP_NAMES.items():
        members = {name: extra for name, (m, ranks, extra) in drawn.items() if m == model and ranks == 2}
        assert len(members) >= 8, group
        for name, extra in members.items():
            layout_and_batch = frozenset(o for o in extra if o not in held_out.SHAPES[model])
            assert (model, layout_and_batch) not in developed, name
            assert [o for o in extra if "model.net." in o] == held_out.SHAPES[model]  # the group's held-out shape
            micro, accumulation = (int(next(o for o in extra if o.startswith(key)).split("=")[1])
                                   for key in ("data.batch_size=", "trainer.accumulate_grad_batches="))
            layout = re.match(rf"{model}-held-(.+)-mb", name).group(1)
            assert micro * accumulation * DATA_RANKS[layout] == held_out.GLOBAL_BATCH[model], name
    # each group's layouts, micro batches and accumulation vary over the draw
    for model in study.GROUP_NAMES:
        layouts = {re.match(rf"{model}-held-(.+)-mb", name).group(1) for name in drawn if drawn[name][0] == model}
        assert len(layouts) >= 3, model


def test_each_groups_held_out_shape_is_one_no_test_uses():
    """Its width, the override that sets the shape apart, appears in no test (this file reads it)."""
    others = [path.read_text() for path in (REPO / "tests").rglob("*.py") if path.name != Path(__file__).name]
    for model, shape in held_out.SHAPES.items():
        width = next(o for o in shape if "n_embd=" in o).removeprefix("+model.net.")
        assert not any(width in text for text in others), (model, width)


@pytest.mark.slow  # composes and validates each of the 40 drawn configurations: about a second each
def test_every_drawn_configuration_is_one_litscale_accepts(tmp_path):
    """A refused configuration would stop the study after its profiles were timed."""
    from helpers.configs import compose_job

    from litscale.app.checks.validation import validate

    for name, config in held_out.draw(study.CONFIGS, seed=0).items():
        overrides = [o for o in study.overrides_of(name, config) if not o.startswith("name=")]
        cfg, choices = compose_job(overrides, tmp_path / name)
        validate(cfg, choices=choices, this_machine=False)


PREDICTED = [0.10, 0.22, 0.31, 0.38, 0.52, 0.61, 0.70, 0.93]
MEASURED = [0.12, 0.20, 0.36, 0.33, 0.55, 0.72, 0.64, 0.90]  # two neighbouring pairs swapped


@pytest.mark.slow  # scipy's bootstrap over 5,000 resamples, not vectorized: seconds
def test_the_bootstrap_intervals_are_scipys_percentile_intervals():
    """MAPE and Spearman of 8 configurations, each interval the 2.5th and 97.5th percentiles over
    resamples of the configurations with replacement: against scipy's bootstrap (paired,
    percentile), each with its own random draws of 5,000 resamples."""
    from scipy.stats import bootstrap, spearmanr

    figures = held_out.bootstrap(PREDICTED, MEASURED, seed=0, resamples=5_000)
    assert figures["spearman"] == pytest.approx(spearmanr(PREDICTED, MEASURED).statistic, abs=1e-12)
    assert figures["mape"] == pytest.approx(statistics.fmean(abs(p / m - 1) for p, m in zip(PREDICTED, MEASURED, strict=True)))

    def scipy_interval(statistic) -> list[float]:
        found = bootstrap((PREDICTED, MEASURED), statistic, paired=True, vectorized=False, method="percentile",
                          n_resamples=5_000, random_state=0)
        return [found.confidence_interval.low, found.confidence_interval.high]

    rho = scipy_interval(lambda x, y: spearmanr(x, y).statistic)
    mape = scipy_interval(lambda x, y: statistics.fmean(abs(p / m - 1) for p, m in zip(x, y, strict=True)))
    assert figures["spearman_interval"] == pytest.approx(rho, abs=0.03)
    assert figures["mape_interval"] == pytest.approx(mape, abs=0.01)
    assert figures["spearman_interval"][0] < 0.9 < figures["spearman"]  # the point clears the bar, the interval not
    perfect = held_out.bootstrap(PREDICTED, sorted(MEASURED), seed=0)  # the same order: every resample's is too
    assert perfect["spearman"] == 1.0 and perfect["spearman_interval"] == [1.0, 1.0]


def held_out_study(low_nano: float) -> dict:
    """A recorded held-out study: GPT-nano ranked with the interval's lower end ``low_nano``."""
    groups = {"GPT-nano": {"configurations": 8, "spearman": 0.97, "spearman_interval": [low_nano, 1.0],
                           "mape": 0.1, "mape_interval": [0.05, 0.15], "shape": held_out.SHAPES["nano"],
                           "global_batch": 16}}
    return {"date": "2026-12-01", "seed": 0, "groups": groups}


@pytest.mark.slow  # composes each group's config with Hydra: seconds
def test_plan_auto_reads_the_held_out_intervals_lower_end():
    """accuracy.json as the study writes it: GPT-nano's held-out figures beside its developed-on
    ones; plan=auto picks where the lower end reaches 0.9 and says so, keeps the layout where
    only the point does, and a group with no held-out study keeps it too."""
    from litscale.planner.trust import trust_for

    results = study_results()
    nano_net = {"_target_": "litscale.models.gpt.build_gpt", "preset": "nano", "dropout": 0.0}
    picked = trust_for(nano_net, study.accuracy_record(results, held_out_study(0.93)))
    assert picked.picks and picked.line() == (
        "plan=auto: model group GPT-nano's held-out Spearman is 0.970, 95% interval 0.930 to 1.000 over 8 "
        "configurations it was not developed on: its lower end is at least 0.9 (experiments/planner/study.py "
        "--held-out, 2026-12-01): the planner picks this job's layout")
    kept = trust_for(nano_net, study.accuracy_record(results, held_out_study(0.71)))
    assert not kept.picks and "its lower end is below 0.9" in kept.reason
    micro = trust_for({**nano_net, "preset": "micro"}, study.accuracy_record(results, held_out_study(0.93)))
    assert not micro.picks and micro.reason == ("model group GPT-micro has no held-out study recorded "
                                                "(python experiments/planner/study.py --held-out)")


def study_results() -> dict:
    import json

    results = json.loads((PLANNER / "results.json").read_text())
    results["metrics"] = study.metrics(results["runs"], study.held_out())
    return results


def test_the_held_out_report_says_the_load_and_what_plan_auto_does():
    runs = {f"nano-held-{i}": {"model": "nano", "global_batch": 16, "predicted_step_s": p, "measured_step_s": m,
                               "load_average": 1.5} for i, (p, m) in enumerate(zip(PREDICTED, MEASURED, strict=True))}
    held = {"date": "2026-12-01", "seed": 0, "per_group": 8, "nice": 15, "machine": "2 cores",
            "load_average": {"before": [1.0, 1.2, 1.4], "after": [1.9, 1.5, 1.4]}, "runs": runs,
            "groups": held_out.group_figures(runs, study.GROUP_NAMES, seed=0)}
    text = held_out.report(held)
    assert "at `nice -n 15`" in text and "load average (1, 5, 15 min) 1.0 / 1.2 / 1.4 before" in text
    assert "**keeps the given layout** (lower end below 0.9)" in text.splitlines()[4]
