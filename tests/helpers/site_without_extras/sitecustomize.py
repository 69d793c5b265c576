"""Run at the start of every interpreter whose PYTHONPATH holds this directory (see
``helpers/without_extras.py``): hides the modules its environment names."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "litscale_test_without_extras", os.path.join(os.path.dirname(os.path.dirname(__file__)), "without_extras.py"))
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_module.block_from_environment()
