"""How far plan=auto trusts the planner: the accuracy study's per-group statistics of the
configurations it was developed on (same-pass and cross-pass Spearman and MAPE, checked against
scipy and the formulas), and a sweep's plan=auto reading the held-out study's interval: keeping
the given layout where its lower end is below the bar, with its one line, and picking above it."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
# experiments/planner/study.py, under a name of its own (other experiments have a study.py too)
_spec = importlib.util.spec_from_file_location("planner_study", REPO / "experiments" / "planner" / "study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)

# Two passes of four GPT-nano configurations and three of GPT-micro at 2 ranks, and one at 1 rank
# (not in a group). Pass 2's measurements swap GPT-nano's two fastest: the cross-pass figures differ.
SYNTHETIC = {
    "nano-a": ("nano", 2, [0.10, 0.12], [0.11, 0.16]),
    "nano-b": ("nano", 2, [0.20, 0.18], [0.19, 0.14]),
    "nano-c": ("nano", 2, [0.30, 0.33], [0.33, 0.30]),
    "nano-d": ("nano", 2, [0.40, 0.38], [0.39, 0.45]),
    "nano-held": ("nano", 2, [0.50, 0.50], [0.10, 0.90]),  # a calibration configuration
    "micro-a": ("micro", 2, [1.0, 1.1], [1.2, 0.9]),
    "micro-b": ("micro", 2, [2.0, 1.9], [1.8, 2.1]),
    "micro-c": ("micro", 2, [3.0, 2.7], [3.3, 2.6]),
    "nano-one": ("nano", 1, [0.2, 0.2], [0.2, 0.2]),
}


def synthetic_runs() -> dict[str, dict]:
    return {name: {"model": model, "ranks": ranks, "global_batch": 16, "predicted_each": predicted,
                   "measured_each": measured, "predicted_step_s": statistics.median(predicted),
                   "measured_step_s": statistics.median(measured)}
            for name, (model, ranks, predicted, measured) in SYNTHETIC.items()}


def hand_spearman(xs: list[float], ys: list[float]) -> float:
    """1 - 6 sum d^2 / (n (n^2 - 1)): the formula for values without ties."""
    def ranks(values):
        return [sorted(values).index(v) for v in values]

    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(ranks(xs), ranks(ys), strict=True)) / (n * (n * n - 1))


def test_each_group_is_scored_on_its_own_same_pass_and_cross_pass():
    from scipy.stats import spearmanr

    runs = synthetic_runs()
    metrics = study.metrics(runs, {"nano-held": "a calibrated term"})
    per_group = metrics["per_group"]
    assert set(per_group) == {"GPT-nano", "GPT-micro"}  # no pooled figure, no 1-rank run
    for group, model in (("GPT-nano", "nano"), ("GPT-micro", "micro")):
        members = [n for n, (m, ranks, _, _) in SYNTHETIC.items() if m == model and ranks == 2 and n != "nano-held"]
        stats = per_group[group]
        assert stats["configurations"] == len(members)
        pairs = {"same": [(0, 0), (1, 1)], "cross": [(0, 1), (1, 0)]}
        for kind, expected in pairs.items():
            assert [(p["predicted_pass"] - 1, p["measured_pass"] - 1) for p in stats[kind]] == expected
            for pair, (p, m) in zip(stats[kind], expected, strict=True):
                predicted = [SYNTHETIC[n][2][p] for n in members]
                measured = [SYNTHETIC[n][3][m] for n in members]
                assert pair["spearman"] == pytest.approx(spearmanr(predicted, measured).statistic, abs=1e-12)
                assert pair["spearman"] == pytest.approx(hand_spearman(predicted, measured), abs=1e-12)
                mape = sum(abs(a - b) / b for a, b in zip(predicted, measured, strict=True)) / len(members)
                assert pair["mape"] == pytest.approx(mape, rel=1e-12)
        lowest = min(stats["cross"], key=lambda pair: pair["spearman"])
        assert stats["lowest_cross_pass"] == lowest
    # GPT-nano: pass 1 ranks perfectly on its own, and 1 - 6 x 2 / 60 against pass 2's swapped pair
    nano = per_group["GPT-nano"]
    assert nano["same"][0]["spearman"] == 1.0 and nano["cross"][0]["spearman"] == pytest.approx(0.8)
    assert metrics["held_out"] == {"nano-held": "a calibrated term"}
    assert "nano-held" not in json.dumps(metrics["groups"])  # nor in the picks


def test_the_contention_configuration_is_held_out_of_the_score():
    from litscale.planner.calibrate import PROBE_MICRO

    assert study.held_out() == {f"nano-ddp-mb{PROBE_MICRO}": "contention (calibrate.py's probe step)"}


@pytest.mark.slow
def test_the_shipped_accuracy_file_is_the_studys_report_of_its_results():
    """accuracy.json is what study.py's report writes from results.json and the recorded held-out
    study, where there is one (no figure by hand)."""
    from litscale.planner.trust import ACCURACY_FILE

    results = json.loads((REPO / "experiments" / "planner" / "results.json").read_text())
    results["metrics"] = study.metrics(results["runs"], study.held_out())
    assert study.accuracy_record(results, study.recorded_held_out()) == json.loads(ACCURACY_FILE.read_text())


def held(low: float) -> dict:
    """A group's held-out figures: Spearman 0.952 over 8 configurations, its interval from ``low``."""
    return {"date": "2026-12-01", "configurations": 8, "spearman": 0.952, "spearman_interval": [low, 1.0]}


def accuracy(nano: float) -> dict:
    """An accuracy file with GPT-nano's held-out Spearman interval's lower end ``nano``."""
    gpt = {"_target_": "litscale.models.gpt.build_gpt", "dropout": 0.0}
    return {"date": "2026-11-24",
            "groups": {"GPT-nano": {"net": {**gpt, "preset": "nano"}, "held_out": held(nano)},
                       "GPT-micro": {"net": {**gpt, "preset": "micro"}, "held_out": held(0.95)}}}
WHERE = "(experiments/planner/study.py --held-out, 2026-12-01)"
UNMEASURED = "(experiments/planner/study.py, 2026-11-24)"


def ranked(low: float) -> str:
    return (f"model group GPT-nano's held-out Spearman is 0.952, 95% interval {low:.3f} to 1.000 over 8 "
            "configurations it was not developed on")


def plan_auto_in_a_sweep(tmp_path, monkeypatch, nano_spearman: float, *overrides: str) -> tuple[dict, str, dict]:
    """``run_plan`` for a job of a sweep (``plan=auto``, GPT-nano's default DDP run of 2 ranks at
    micro batch 16, planned for one H100 node; GPT-nano's held-out Spearman ``nano_spearman``);
    returns its result, what it printed, and the experiment it wrote."""
    from helpers.configs import compose_job

    from litscale.app import scaling_study
    from litscale.app.checks.validation import validate
    from litscale.app.plan import ranking as plan_module
    from litscale.app.plan.description import describe
    from litscale.planner import trust

    user = ["plan=auto", "cluster=h100_8x", "strategy=ddp", "trainer.devices=2", "data.seq_len=32", *overrides]
    cfg, choices = compose_job(user, tmp_path / "job")
    monkeypatch.setattr(trust, "load_accuracy", lambda: accuracy(nano_spearman))
    monkeypatch.setattr(plan_module, "_dry_run", lambda run: (None, None))  # not what is tested here
    monkeypatch.setattr(plan_module, "_trace_collectives", lambda *args: None)
    printed: list[str] = []
    monkeypatch.setattr(plan_module, "_say", printed.append)
    job = scaling_study.ScalingContext(overrides=user, sweep_dir=str(tmp_path))  # a job of a sweep
    result = plan_module.run_plan(describe(cfg, choices, validate(cfg, choices=choices, this_machine=False), job=job))
    experiment = OmegaConf.to_container(OmegaConf.load(tmp_path / "job" / "plan" / "experiment" / "planned.yaml"))
    return result, "\n".join(printed), experiment


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plan_auto_in_a_sweep_keeps_the_given_layout_below_the_bar(tmp_path, monkeypatch):
    result, printed, experiment = plan_auto_in_a_sweep(tmp_path, monkeypatch, 0.714)
    line = f"plan=auto: {ranked(0.714)}: its lower end is below 0.9 {WHERE}: this job keeps its given layout"
    assert line in printed.splitlines()
    assert result["plan/picked"] is False and result["plan/winner"] == []
    assert {"override /strategy": "ddp"} in experiment["defaults"] and experiment["trainer"]["devices"] == 2
    assert "batch_size" not in experiment.get("data", {})  # the given micro batch, as composed


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plan_auto_in_a_sweep_picks_above_the_bar_and_names_an_unmeasured_model(tmp_path, monkeypatch):
    result, printed, experiment = plan_auto_in_a_sweep(tmp_path, monkeypatch, 0.95)
    line = f"plan=auto: {ranked(0.95)}: its lower end is at least 0.9 {WHERE}: the planner picks this job's layout"
    assert line in printed.splitlines() and result["plan/picked"] is True
    fastest = next(x for x in printed.splitlines() if x.startswith("fastest: "))
    assert fastest.endswith(" ".join(result["plan/winner"]))
    assert experiment["data"]["batch_size"] == int(next(o for o in result["plan/winner"]
                                                        if o.startswith("data.batch_size=")).split("=")[1])

    from litscale.planner.trust import trust_for

    gpt = {"_target_": "litscale.models.gpt.build_gpt", "dropout": 0.0, "vocab_size": 256, "block_size": 32}
    assert trust_for({**gpt, "preset": "micro"}, accuracy(0.95)).picks  # the data's shape is not the model
    longer = accuracy(0.95)
    longer["groups"]["GPT-micro at 512 tokens"] = {"net": longer["groups"]["GPT-micro"]["net"], "held_out": held(0.4)}
    twice = trust_for({**gpt, "preset": "micro"}, longer)  # measured in two groups: the worse one decides
    assert not twice.picks and twice.reason.startswith("model group GPT-micro at 512 tokens's held-out Spearman is "
                                                       "0.952, 95% interval 0.400")
    longer["groups"]["GPT-micro"]["seq_len"], longer["groups"]["GPT-micro at 512 tokens"]["seq_len"] = 128, 512
    at_128 = trust_for({**gpt, "preset": "micro"}, longer, seq_len=128)  # the group measured at the job's length
    assert at_128.picks and at_128.reason.startswith("model group GPT-micro's held-out Spearman is 0.952, 95% interval 0.950")
    assert not trust_for({**gpt, "preset": "micro"}, longer, seq_len=512).picks
    assert not trust_for({**gpt, "preset": "micro"}, longer, seq_len=1024).picks  # at neither: the worse one
    for other in ({**gpt, "preset": "small"}, {**gpt, "preset": "nano", "n_layer": 8}):
        unmeasured = trust_for(other, accuracy(0.95))
        assert unmeasured.line() == (f"plan=auto: litscale.models.gpt.build_gpt preset {other['preset']} as "
                                     f"configured is in no measured model group (GPT-nano, GPT-micro) {UNMEASURED}: "
                                     "this job keeps its given layout")
        assert not unmeasured.picks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plan_auto_in_a_sweep_replaces_a_given_layout_that_does_not_fit_below_the_bar(tmp_path, monkeypatch):
    """Keeping the given layout must not run a job out of memory: with the device's memory half
    of what the given layout needs, the pick is written all the same, and the line says why."""
    _, printed, _ = plan_auto_in_a_sweep(tmp_path / "fits", monkeypatch, 0.714)
    given = next(x for x in printed.splitlines() if x.startswith("as configured: ddp "))
    needs = float(given.split(": ")[2].split(" GiB per rank")[0])
    memory = f"cluster.device_memory_bytes={int(needs / 2 * 2**30)}"
    result, printed, experiment = plan_auto_in_a_sweep(tmp_path / "too_big", monkeypatch, 0.714, memory)
    line = (f"plan=auto: {ranked(0.714)}: its lower end is below 0.9 {WHERE}, but the given layout does not fit: "
            "the planner picks this job's layout")
    assert line in printed.splitlines() and result["plan/picked"] is True
    assert experiment["data"]["batch_size"] == int(next(o for o in result["plan/winner"]
                                                        if o.startswith("data.batch_size=")).split("=")[1])
    assert experiment["data"]["batch_size"] < 16


@pytest.mark.slow  # over half a second alone
def test_a_job_is_trusted_by_the_group_measured_at_its_sequence_length(tmp_path, monkeypatch):
    """The shipped study measured Llama-tiny at 128 and at 512 tokens: a Llama-tiny job reads the
    group at its own ``data.seq_len``, and the lower interval of the two at a length measured in
    neither (each given held-out figures here); a group without a held-out study keeps the layout."""
    from helpers.configs import compose_job, described

    from litscale.app.plan import ranking
    from litscale.planner import trust

    shipped = trust.load_accuracy()
    for seq_len in (128, 512):
        found = ranking.configured_trust(described(*compose_job(["model=llama", f"data.seq_len={seq_len}"],
                                                                 tmp_path / f"shipped{seq_len}")))
        group = next(name for name, g in shipped["groups"].items() if name.startswith("Llama-tiny")
                     and g["seq_len"] == seq_len)
        if "held_out" not in shipped["groups"][group]:
            assert not found.picks and found.reason == (f"model group {group} has no held-out study recorded "
                                                        "(python experiments/planner/study.py --held-out)")
    lows = {128: 0.95, 512: 0.8}
    groups = {name: {**g, "held_out": held(lows[g["seq_len"]])} for name, g in shipped["groups"].items()}
    monkeypatch.setattr(trust, "load_accuracy", lambda: {**shipped, "groups": groups})
    for seq_len, expected in (*lows.items(), (256, min(lows.values()))):
        found = ranking.configured_trust(described(*compose_job(["model=llama", f"data.seq_len={seq_len}"],
                                                                 tmp_path / str(seq_len))))
        assert f"95% interval {expected:.3f} to 1.000" in found.reason
        assert found.picks is (expected >= trust.SPEARMAN_BAR)
