"""How the loops seed their samples: one seed per synchronous step (sample i of the step draws stream i),
or one per group (sample k of group j draws stream k of seed j), the asynchronous loop's way and the
synchronous loop's with `grpo.sample_seeds=group` (tests/test_async_run.py runs both loops on it)."""

from __future__ import annotations

import pytest

from posttrain.generation.engine import GenerationEngine
from posttrain.generation.params import SamplingParams
from posttrain.models.hf import build_tiny_model
from posttrain.rollout import episodes
from posttrain.rollout.groups import group_seed, sample_groups
from posttrain.tasks.datasets import PromptItem, RepeatCounter

VOCAB = 40
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, stop_at_eos=False)
ITEMS = [PromptItem(i, f"p{i}", [3 + i, 7, 9 + i], {}) for i in range(3)]


def test_a_group_seeded_alone_draws_what_it_draws_in_a_batch_of_groups():
    engine = GenerationEngine(build_tiny_model(VOCAB, seed=0))
    seeds = [group_seed(5, it.prompt_id, 0) for it in ITEMS]
    batch = sample_groups(engine, ITEMS, 4, SAMPLING, seeds)
    assert len(batch) == 12
    for j, it in enumerate(ITEMS):
        alone = engine.generate([it.prompt_token_ids] * 4, SAMPLING.model_copy(update={"seed": seeds[j]}))
        assert [r.token_ids for r in batch[4 * j : 4 * j + 4]] == [r.token_ids for r in alone]
    # one seed for the batch: sample i draws stream i of it, so its groups differ from the above
    one = sample_groups(engine, ITEMS, 4, SAMPLING, seeds[0])
    assert [r.token_ids for r in one[:4]] == [r.token_ids for r in batch[:4]]  # streams 0-3 of seed 0
    assert [r.token_ids for r in one[4:]] != [r.token_ids for r in batch[4:]]
    with pytest.raises(ValueError, match="3 prompts but 2 group seeds"):
        sample_groups(engine, ITEMS, 4, SAMPLING, seeds[:2])


def test_episodes_of_a_step_take_the_seed_of_their_group(monkeypatch):
    drawn = []

    async def run_group(engine, tokenizer, suite, sample, group_size, sampling, seed, first_stream=0):
        drawn.append((sample, seed, first_stream))
        return [f"{sample}/{k}" for k in range(group_size)]

    class Suite:
        @staticmethod
        def sample(item):
            return item.prompt_id

    monkeypatch.setattr(episodes, "run_group", run_group)
    out = episodes.play_step(None, None, Suite(), ITEMS, 3, SAMPLING, 7)
    assert drawn == [(0, 7, 0), (1, 7, 3), (2, 7, 6)]  # one seed: streams i * G + k
    assert out == ["0/0", "0/1", "0/2", "1/0", "1/1", "1/2", "2/0", "2/1", "2/2"]
    drawn.clear()
    episodes.play_step(None, None, Suite(), ITEMS, 3, SAMPLING, [11, 12, 13])
    assert drawn == [(0, 11, 0), (1, 12, 0), (2, 13, 0)]  # a seed per group: streams k


def test_a_prompt_drawn_again_at_the_same_weights_draws_a_seed_of_its_own():
    counter = RepeatCounter()
    first = counter.mark(ITEMS[0], 3)
    again = counter.mark(ITEMS[0], 3)
    other = counter.mark(ITEMS[1], 3)
    assert first is ITEMS[0] and other is ITEMS[1]  # first draws: the item itself, repeat 0
    assert again.repeat == 1 and again.prompt_id == 0 and ITEMS[0].repeat == 0
    assert counter.mark(ITEMS[0], 4).repeat == 0  # a new version starts the count again
    seeds = {group_seed(5, 0, 3, r) for r in range(3)}
    assert len(seeds) == 3 and group_seed(5, 0, 3) == group_seed(5, 0, 3, 0)
    engine = GenerationEngine(build_tiny_model(VOCAB, seed=0))
    items = [first, again]
    groups = sample_groups(
        engine, items, 4, SAMPLING, [group_seed(5, it.prompt_id, 3, it.repeat) for it in items]
    )
    assert [r.token_ids for r in groups[:4]] != [r.token_ids for r in groups[4:]]
