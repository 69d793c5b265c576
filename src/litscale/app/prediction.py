"""The planner's prediction for this run, as data: made once in ``train()`` with the layout,
before any rank starts (``litscale.app.plan.runs.predict_run``), carried in the run spec to
rank 0, and held there to the step the run measured (``summary.json``'s ``plan/*``). Nothing
of the planner runs on a rank: a prediction the run contradicted on this machine is recorded
by ``train()`` once the ranks are done (``litscale.app.plan.runs.record_contradiction``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class RunPrediction:
    """What the planner predicted for the run as configured, and what holding a measurement to
    it needs. Plain data: it travels to the ranks with the run spec."""

    figures: dict = field(default_factory=dict)
    """``plan/*`` as ``summary.json`` holds them (``plan/cluster``, ``plan/predicted_step_s``,
    ``plan/compute_source``, ``plan/predicted_peak_bytes``, ``plan/predicted_states_bytes``);
    ``plan/withheld`` where an earlier run contradicted it, ``plan/error`` where it failed; {}
    where none is made (``plan.predict_run=false``, a strategy the planner does not cost, an
    uncalibrated ``local_cpu``)."""
    contradiction_factor: float = 2.0
    """A measured step more than this many times off the prediction, either way, contradicts it
    (``litscale.planner.profile_cache.CONTRADICTION_FACTOR``)."""
    cached_as: dict | None = None
    """On this machine, where the prediction read the profile cache: the cache's key of it
    (``identity``, the plan's ``layout`` and ``profile_key``), for ``train()`` to record a
    contradiction under; None elsewhere (the cluster file is the user's: the line only says how
    far off it was)."""

    def held_to(self, measured_step_s: float | None) -> dict:
        """The figures, with ``plan/off_by`` where ``measured_step_s`` contradicts the predicted
        step, and ``plan/dropped`` where that prediction is not used again (this machine's)."""
        result = dict(self.figures)
        predicted = result.get("plan/predicted_step_s")
        if not measured_step_s or not predicted:
            return result
        off_by = max(measured_step_s / predicted, predicted / measured_step_s)
        if off_by > self.contradiction_factor:
            result["plan/off_by"] = off_by
            if self.cached_as is not None:
                result["plan/dropped"] = True
        return result
