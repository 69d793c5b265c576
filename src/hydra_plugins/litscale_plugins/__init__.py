"""litscale's Hydra launchers and sweeper (Hydra finds plugins only in the ``hydra_plugins`` package)."""
