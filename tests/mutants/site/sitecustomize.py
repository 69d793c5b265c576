"""Every interpreter ``make mutants`` starts begins here (``PYTHONPATH``): the defect named by
``LITSCALE_MUTANT`` is planted before anything else is imported (``tests/mutants/plant.py``)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("litscale_mutant_plant", Path(__file__).resolve().parents[1] / "plant.py")
_plant = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plant)
_plant.plant_from_environment()
