"""Health of a multi-rank job: each rank's heartbeat in the launcher's key-value store, a
watchdog that turns a hang into one line and a stop, and per-rank step times for straggler
reports. Lightning callbacks wire these in (``litscale.callbacks.watchdog``,
``litscale.callbacks.straggler``); nothing here imports Lightning.
"""
