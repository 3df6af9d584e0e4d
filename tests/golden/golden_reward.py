"""A dense, deterministic reward for the golden runs (a random tiny model scores 0 on arithmetic, which
would pin nothing): every completion gets a different reward, and about one in eleven fails (marked,
never 0), so advantages, the failure path and the optimizer all move."""


def reward(prompts, completions, metadata):
    out = []
    for c in completions:
        code = sum(ord(ch) * (i + 1) for i, ch in enumerate(c))
        if code % 11 == 0:
            raise RuntimeError("golden reward refuses this completion")
        out.append((code % 7) / 6.0)
    return out
