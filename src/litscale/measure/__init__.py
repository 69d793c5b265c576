"""Measurement that every floor above may use; imports nothing of litscale.

- ``flops``: a step's FLOPs (the model's formula, else counted on the meta device) and a
  device's peak (Lightning's table, or a CPU's measured once), for MFU and the planner.
- ``tensor_bytes``: the bytes tensors hold on this rank, each storage counted once.
- ``step_memory``: the peak of tensor memory inside one CPU step (torch's ``MemTracker``).
"""
