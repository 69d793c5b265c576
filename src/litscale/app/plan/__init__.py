"""plan=show|auto: the planner inside the app (ranking, the dry run, the profiles it times,
the verifying runs). The planner itself, which imports no Hydra, is ``litscale.planner``."""
