"""The planner's prediction for a run: made once in ``train()`` with the layout, before any rank
starts, carried in the run spec to rank 0's summary, and held there to the step the run
measured (``litscale.app.prediction``); nothing of the planner runs after ``fit``."""

from __future__ import annotations

import json
import pickle

import pytest

from litscale.app.prediction import RunPrediction

FIGURES = {"plan/cluster": "local_cpu", "plan/predicted_step_s": 2.0, "plan/compute_source": "timed",
           "plan/predicted_peak_bytes": 10, "plan/predicted_states_bytes": 4}
CACHED_AS = {"identity": {"net": {}}, "layout": "ddp 1x1x1x1", "profile_key": "plain"}


def test_a_measured_step_more_than_twice_off_contradicts_the_prediction_either_way():
    here = RunPrediction(figures=FIGURES, contradiction_factor=2.0, cached_as=CACHED_AS)
    assert here.held_to(None) == FIGURES  # no measurement (a step watched for memory): the figures alone
    assert here.held_to(3.9) == FIGURES and here.held_to(1.05) == FIGURES  # within 2x either way
    assert here.held_to(0.5) == {**FIGURES, "plan/off_by": 4.0, "plan/dropped": True}
    assert here.held_to(5.0) == {**FIGURES, "plan/off_by": 2.5, "plan/dropped": True}
    # Another cluster's figures are the user's: said, not dropped from a cache.
    elsewhere = RunPrediction(figures=FIGURES, contradiction_factor=2.0)
    assert elsewhere.held_to(0.5) == {**FIGURES, "plan/off_by": 4.0}
    withheld = RunPrediction(figures={"plan/cluster": "local_cpu", "plan/withheld": {"run": "x"}})
    assert withheld.held_to(0.5) == withheld.figures
    assert RunPrediction().held_to(1.0) == {}


@pytest.mark.slow  # a Hydra composition, a validation and a model's facts traced: seconds
def test_train_predicts_once_before_launch_and_hands_the_prediction_to_the_ranks(tmp_path, monkeypatch):
    from helpers.configs import compose_job

    from litscale.app import run
    from litscale.app.plan import runs
    from litscale.planner import cost

    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path))
    (tmp_path / "cluster_local_cpu.json").write_text(json.dumps(
        {"cores": 2, "memory_bytes": 8 * 2**30, "peak_flops": {"float32": 1e11, "bfloat16": 2e11},
         "bandwidth_bytes_s": 1e9, "latency_s": 1e-4, "measured": "test"}))
    events, predict, recorded = [], cost.predict, []

    def counted_predict(*args, **kwargs):
        events.append("predict")
        return predict(*args, **kwargs)

    def launched(entrypoint, spec, **kwargs):
        events.append("launch")
        ranks_spec = pickle.loads(pickle.dumps(spec))  # as the launcher hands it to each rank
        held = ranks_spec.prediction.held_to(spec.prediction.figures["plan/predicted_step_s"] * 3)
        return {**held, "perf/step_time_s": 1.0, "output_dir": str(tmp_path / "run")}

    monkeypatch.setattr(cost, "predict", counted_predict)
    monkeypatch.setattr(run, "launch", launched)
    monkeypatch.setattr(runs, "record_contradiction", lambda prediction, summary: recorded.append(summary))
    cfg, choices = compose_job(["data.seq_len=32", "trainer.max_steps=2"], tmp_path / "run")
    result = run.train(cfg, choices=choices)
    assert events == ["predict", "launch"]  # once, before any rank starts; never after
    assert result["plan/cluster"] == "local_cpu" and result["plan/predicted_step_s"] > 0
    assert result["plan/off_by"] == pytest.approx(3.0) and result["plan/dropped"]
    assert recorded == [result]  # the contradiction recorded by train() once the ranks are done
