"""The rollout layer: what the synchronous and the asynchronous loop share, below both.

- config.py: `GroupConfig` (group size, advantages, overlong handling, validation, seed),
  `RolloutWorkerConfig` (what an engine worker is built from), `RolloutConfig` (where workers run);
- groups.py: seeds, sampling a group from an engine, scoring it (failed rewards marked);
- advantages.py: rewards -> advantages within each group;
- rows.py: groups -> training rows (one batch, or per-group numpy rows that stack into it), the codec;
- validation.py: held-out accuracy / pass@k;
- contracts.py, engine_worker.py, ray_worker.py: the rollout-worker protocol and its local and Ray
  implementations.
It takes plain arguments and typed configs; nothing here knows a loop.
"""
