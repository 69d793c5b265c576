"""Validation of a composed config, before any process or process group exists: one sequence,
``validation.validate``, which returns the run layout. Each module is one kind of check, in
the order ``validate`` reads them; every problem one ``ConfigError`` line naming the key, the
bad value and what is allowed.

- ``validation``: the sequence, and each node against its ``_target_``'s signature;
- ``schemas``: the keys that are no constructor's arguments (``seed``, ``ckpt_path``, ...);
- ``safety``: which ``_target_``s a config may build (checked before any is imported);
- ``width``: µP's widths and base width;
- ``contract``: what the chosen strategy accepts (its contract's answer, ``litscale.parallel.contract``);
- ``devices``: the devices asked for exist here, and the precision runs on them;
- ``checkpoint``: what ``ckpt_path`` resumes fits the network, the layout and the sample position;
- ``fault_tolerance``: ``fault_tolerance=replicas`` against the rest of the config;
- ``extras``: the optional packages a choice needs are installed;
- ``collectives``: ``preflight.collectives=true``, every rank's first step traced and compared.
"""
