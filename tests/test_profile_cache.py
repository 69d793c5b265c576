"""The planner's caches cannot poison a prediction: a profile is read back only by the same
litscale code, torch and machine that timed it; a timing taken while the machine was busy is
used once and not kept; a calibration from another machine is not read; and a prediction that
a run's own measurement contradicts by more than 2x says so and is not used again until the
model is timed again."""

from __future__ import annotations

import json

import pytest
from helpers.configs import compose_job, described

from litscale.measure import flops
from litscale.planner import calibrate, machine, profile_cache
from litscale.planner.model_facts import Profile

# A made-up calibration of this machine (no ``machine`` key: written by hand, so taken as it is).
CALIBRATION = {"cores": 2, "memory_bytes": 8 * 2**30, "peak_flops": {"float32": 1e11, "bfloat16": 2e11},
               "bandwidth_bytes_s": 1e9, "latency_s": 1e-4, "measured": "test"}
PROFILE_S = 0.5  # the made-up child's seconds per sample of a micro batch


@pytest.fixture
def cached_run(tmp_path, monkeypatch):
    """A DDP-less GPT-nano run on a made-up calibration, its model 'timed' by a made-up child
    (seconds recorded in ``timed``) and cached as ``plan=show`` does."""
    from litscale.app.build import build
    from litscale.app.checks.validation import validate
    from litscale.app.plan import profile as plan_profile
    from litscale.app.plan import ranking
    from litscale.app.plan.runs import predict_run, record_contradiction

    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path))
    monkeypatch.delenv(flops.MAX_LOAD_ENV, raising=False)
    monkeypatch.setattr(flops, "load_average", lambda: 0.5)
    monkeypatch.setattr(flops, "others_load", lambda since: 0.0)  # nobody else on the cores meanwhile
    (tmp_path / "cluster_local_cpu.json").write_text(json.dumps(CALIBRATION))
    timed: list[dict] = []

    def child(net_config, *, keys, seq_len, vocab_size, compression=None, packed_documents=False):
        timed.append(keys)
        return {key: Profile({m: PROFILE_S * m for m in micros}, 0.25) for key, micros in keys.items()}

    monkeypatch.setattr(plan_profile, "profiles_in_child", child)
    cfg, choices = compose_job(["data.seq_len=32"], tmp_path / "run")
    run = described(cfg, choices, validate(cfg, choices=choices))
    plan = ranking.configured_plan(run)

    def plan_show():
        return ranking.timed_here(run, build(cfg.cluster), ranking.facts_of(run), [plan])

    def predicted(measured_step_s=None):
        """As a run does: ``train()`` predicts before launch, rank 0's summary holds the
        measured step to it, and ``train()`` records a contradiction once the ranks are done."""
        prediction = predict_run(run)
        held = prediction.held_to(measured_step_s)
        record_contradiction(prediction, {**held, "perf/step_time_s": measured_step_s,
                                          "output_dir": str(tmp_path / "run")})
        return held

    plan_show()
    assert timed == [{"plain": {16}}]
    return plan_show, predicted, timed


@pytest.mark.full
@pytest.mark.slow  # composes a job: over a second
def test_a_profile_is_read_back_only_by_the_code_torch_and_machine_that_timed_it(cached_run, monkeypatch):
    import litscale

    plan_show, predicted, timed = cached_run
    assert predicted()["plan/compute_source"] == "timed"
    elsewhere = {"another checkout's code": (profile_cache, "code_digest", lambda: "0" * 16),
                 "another litscale": (litscale, "__version__", "9.9.9"),
                 "another machine": (machine, "fingerprint", lambda: {"cpu": "another", "cores": 64})}
    for what, (owner, name, value) in elsewhere.items():
        with monkeypatch.context() as patched:
            patched.setattr(owner, name, value)
            assert predicted()["plan/compute_source"] == "flops", what  # FLOPs, not the other's timing
    assert predicted()["plan/compute_source"] == "timed" and len(timed) == 1  # its own, still there


@pytest.mark.full
@pytest.mark.slow
def test_profiles_timed_on_a_busy_machine_serve_that_plan_and_are_not_cached(cached_run, monkeypatch, capsys):
    plan_show, predicted, timed = cached_run
    monkeypatch.setattr(flops, "cores", lambda: 2)
    monkeypatch.setattr(flops, "load_average", lambda: 3.5)
    monkeypatch.setattr(profile_cache, "code_digest", lambda: "another checkout")  # nothing cached for it
    facts = plan_show()
    assert timed[1:] == [{"plain": {16}}]
    assert facts.profiles["plain"].forward_backward_s == {16: 16 * PROFILE_S}  # this plan used it
    assert facts.profiles["plain"].load_average == 3.5
    assert capsys.readouterr().out.splitlines()[-1] == (
        "litscale: profiles plain timed at a load average 3.50 above this machine's 2 cores: "
        "used for this plan, not cached")
    assert predicted()["plan/compute_source"] == "flops"  # not kept
    plan_show()
    assert len(timed) == 3  # timed again: nothing was kept
    monkeypatch.setenv(flops.MAX_LOAD_ENV, "4")
    plan_show()
    assert predicted()["plan/compute_source"] == "timed" and len(timed) == 4  # kept under the stated limit
    # A quiet load average before, another process on a core during: not kept either.
    monkeypatch.delenv(flops.MAX_LOAD_ENV)
    monkeypatch.setattr(flops, "load_average", lambda: 0.5)
    monkeypatch.setattr(flops, "others_load", lambda since: 0.9)
    monkeypatch.setattr(profile_cache, "code_digest", lambda: "a third checkout")
    plan_show()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "litscale: profiles plain timed at a moment when other processes kept 0.90 of this machine's 2 cores busy "
        "(above 0.25 of a core): used for this plan, not cached")
    assert predicted()["plan/compute_source"] == "flops" and len(timed) == 5


@pytest.mark.full
@pytest.mark.slow
def test_a_prediction_a_run_contradicts_by_more_than_2x_is_said_and_not_used_until_timed_again(cached_run, capsys):
    from litscale.app.summary import _print_prediction

    plan_show, predicted, timed = cached_run
    prediction = predicted()["plan/predicted_step_s"]
    assert prediction == pytest.approx(16 * PROFILE_S + 0.25)
    close = predicted(measured_step_s=prediction / 1.9)
    assert "plan/off_by" not in close and predicted()["plan/compute_source"] == "timed"

    measured = prediction / 3
    contradicted = {"perf/step_time_s": measured, **predicted(measured_step_s=measured)}
    assert contradicted["plan/off_by"] == pytest.approx(3.0) and contradicted["plan/dropped"]
    _print_prediction(contradicted)
    assert capsys.readouterr().out == (
        f"litscale: planner: predicted {prediction:.4g} s/step on cluster local_cpu, measured {measured:.4g} "
        "s/step: 3.0x off, so no longer used for this model and layout (plan=show times it again)\n")

    withheld = {"perf/step_time_s": measured, **predicted(measured_step_s=measured)}
    assert "plan/predicted_step_s" not in withheld
    _print_prediction(withheld)
    assert capsys.readouterr().out == (
        f"litscale: planner: no prediction for this model and layout: its last one, {prediction:.4g} s/step, "
        f"was contradicted by the {measured:.4g} s/step measured in {withheld['plan/withheld']['run']}; "
        "plan=show times it again\n")

    plan_show()
    assert timed[1:] == [{"plain": {16}}]  # the contradicted key is timed again
    again = predicted()
    assert again["plan/compute_source"] == "timed" and "plan/withheld" not in again


def test_a_contradiction_on_a_described_cluster_is_said_without_blaming_a_cache(capsys):
    from litscale.app.summary import _print_prediction

    _print_prediction({"plan/predicted_step_s": 1.0, "plan/cluster": "h100_8x", "perf/step_time_s": 2.5,
                       "plan/off_by": 2.5})
    assert capsys.readouterr().out == ("litscale: planner: predicted 1 s/step on cluster h100_8x, measured 2.5 "
                                       "s/step: 2.5x off (cluster=h100_8x's figures are not this run's)\n")


@pytest.fixture
def fast_calibration(tmp_path, monkeypatch):
    """``calibrate()`` with its timings made up (each takes seconds for real)."""
    from litscale.planner.cluster import Link

    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path))
    monkeypatch.delenv(flops.MAX_LOAD_ENV, raising=False)
    monkeypatch.setattr(flops, "cores", lambda: 2)
    monkeypatch.setattr(calibrate, "probe_matmul_flops", lambda dtype, seconds: 1e10)
    gather = Link(bandwidth_bytes_s=5e8, latency_s=2e-5)
    link = Link(bandwidth_bytes_s=1e9, latency_s=1e-5, collectives={"all-gather": gather})
    monkeypatch.setattr(calibrate, "measure_link", lambda: (link, {"all-gather": {4096: 2.4e-5}}))
    monkeypatch.setattr(calibrate, "measure_contention", lambda ranks, link: 1.2)
    monkeypatch.setattr(flops, "others_load", lambda since: 0.0)  # nobody else on the cores meanwhile
    return tmp_path / "cluster_local_cpu.json"


def test_a_calibration_timed_on_a_busy_machine_is_used_once_and_not_written(fast_calibration, monkeypatch, capsys):
    monkeypatch.setattr(flops, "load_average", lambda: 2.6)
    cluster = calibrate.local_cpu()
    assert cluster.peak_flops["float32"] == 1e10 and not fast_calibration.exists()
    assert capsys.readouterr().err == (
        f"litscale: this machine's calibration not written to {fast_calibration}: timed at a load average 2.60 "
        "above this machine's 2 cores; used for this command only\n")
    monkeypatch.setattr(flops, "load_average", lambda: 1.9)
    calibrate.local_cpu()
    figures = json.loads(fast_calibration.read_text())
    assert figures["load_average"] == 1.9 and figures["machine"] == machine.fingerprint()


def test_a_calibration_while_another_process_takes_a_core_is_used_once_and_not_written(
        fast_calibration, monkeypatch, capsys):
    # The load average before it began saw nothing (it lags a minute): what the cores gave
    # others while it ran does. Such a calibration measured two ranks' contention as 2.24x
    # where alone it is 1.05x, and every 2-rank prediction came out 2.2x slow.
    monkeypatch.setattr(flops, "load_average", lambda: 0.4)
    monkeypatch.setattr(flops, "others_load", lambda since: 0.84)
    assert calibrate.local_cpu().contention == 1.2 and not fast_calibration.exists()
    assert capsys.readouterr().err == (
        f"litscale: this machine's calibration not written to {fast_calibration}: timed at a moment when other "
        "processes kept 0.84 of this machine's 2 cores busy (above 0.25 of a core); used for this command only\n")
    monkeypatch.setattr(flops, "others_load", lambda since: 0.2)
    calibrate.local_cpu()
    assert json.loads(fast_calibration.read_text())["others_load"] == 0.2


def test_each_collectives_measured_figures_are_written_and_read_back(fast_calibration, monkeypatch):
    monkeypatch.setattr(flops, "load_average", lambda: 0.1)
    calibrate.calibrate()
    figures = json.loads(fast_calibration.read_text())
    assert figures["collectives"] == {"all-gather": {"latency_s": 2e-5, "bandwidth_bytes_s": 5e8,
                                                     "seconds_by_bytes": {"4096": 2.4e-5}}}
    link = calibrate.local_cpu().intra_node
    assert link.seconds(1e6, messages=3, kind="all-gather") == 3 * 2e-5 + 1e6 / 5e8
    assert link.seconds(1e6, messages=3, kind="reduce-scatter") == 3 * 1e-5 + 1e6 / 1e9  # not measured: the link's


def test_a_calibration_from_another_machine_or_torch_is_not_read(fast_calibration, monkeypatch):
    monkeypatch.setattr(flops, "load_average", lambda: 0.1)
    figures = calibrate.calibrate()
    assert calibrate.calibrated_figures() == json.loads(json.dumps(figures))  # as written
    moved = {**figures, "machine": {**figures["machine"], "cpu": "another processor"}}
    fast_calibration.write_text(json.dumps(moved))
    assert calibrate.stale(moved) == "it was measured on another machine" and calibrate.calibrated_figures() is None
    older = {**figures, "torch": "2.0.0"}
    assert calibrate.stale(older).startswith("it was measured with torch 2.0.0, this is ")
    unrecorded = {k: v for k, v in figures.items() if k != "machine"}
    assert calibrate.stale(unrecorded) == "it was measured by an older litscale, which did not record the machine"
    unwatched = {k: v for k, v in figures.items() if k != "others_load"}
    assert calibrate.stale(unwatched) == ("it was measured by an older litscale, which kept it whatever other "
                                          "processes took of the cores while it ran")
    all_reduce_only = {k: v for k, v in figures.items() if k != "collectives"}
    assert calibrate.stale(all_reduce_only) == "it was measured by an older litscale, which timed the all-reduce only"
    assert calibrate.stale(CALIBRATION) is None  # written by hand: taken as written
    monkeypatch.setattr(calibrate, "probe_matmul_flops", lambda dtype, seconds: 2e10)
    assert calibrate.local_cpu().peak_flops["float32"] == 2e10  # a plan measures this machine again
    assert calibrate.calibrated_figures()["machine"] == machine.fingerprint()


def test_the_code_a_profile_depends_on_is_where_the_cache_reads_it():
    """Every part of ``TIMED_CODE`` exists in the package (a moved module left behind in the
    list made every digest, and so every run's prediction, fail)."""
    from pathlib import Path

    package = Path(profile_cache.__file__).resolve().parents[1]
    assert [part for part in profile_cache.TIMED_CODE if not (package / part).exists()] == []
    assert len(profile_cache.code_digest()) == 16
