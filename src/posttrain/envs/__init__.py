"""Multi-turn environments and tools: the episode protocol (envs/base.py), typed tools and tool-call
parsers (envs/tools.py) and the built-in environments. Environments know messages, not engines: the
rollout layer runs them (rollout/trajectory.py)."""
