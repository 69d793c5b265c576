"""litscale's Hydra launchers (Hydra finds plugins only in the ``hydra_plugins`` package)."""
