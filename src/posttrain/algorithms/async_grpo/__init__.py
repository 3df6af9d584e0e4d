"""Streaming asynchronous GRPO, one file per part:

- config.py: `AsyncGRPOConfig` (the `async_grpo:` section) and `AsyncGRPORunConfig` (a whole run);
- contracts.py: the trainer protocol, the hooks, errors, and the bounded wait;
- ledger.py: buffered groups, the staleness sampler, the ledger of every group's state;
- meters.py: idle fractions, staleness histogram, counters;
- pool.py: the rollout workers, their requests, retries and weight pushes;
- controller.py: `AsyncGRPOController`, the loop that streams groups into split train steps;
- trainer.py: the Policy as the controller's trainer (a serial thread, chunked training);
- run.py: `run_async_grpo`, the real run around the controller (workers, validation, checkpoints).
Rollout workers themselves live in the rollout layer (posttrain/rollout/).
"""
