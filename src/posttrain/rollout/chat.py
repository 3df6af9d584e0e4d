"""Messages to token ids for multi-turn trajectories, without ever re-tokenizing what the model wrote.

A trajectory's token ids are built by appending, never by re-rendering: the opening messages rendered
with the chat template (`add_generation_prompt=True`), then each reply exactly as sampled, then the
ids of the *new* messages only. A template may rewrite earlier turns when it renders a whole
conversation (drop reasoning blocks from past assistant turns, normalise whitespace, re-serialise tool
calls); rendering the conversation again would then train ids the model never sampled. So the ids of
new messages are the template's rendering of them after a fixed dummy exchange, cut right after the
token that closes the dummy reply (`<|im_end|>` in ChatML): the same ids the template puts there,
whatever the earlier turns hold. The cut is found from the dummy reply's text in that rendering, not
from the dummy exchange rendered alone: a template may render the last assistant turn of a
conversation differently from one that more messages follow (Qwen3 puts an empty
`<think>\n\n</think>\n\n` before the last reply only); what comes before the reply may then differ
by such a block, and the reply and its closing must be the same.
"""

from __future__ import annotations

from typing import Any

from posttrain.envs.base import Message

_PROBE_USER = {"role": "user", "content": "u"}
_PROBE_REPLY = "\x07\x07"  # no real reply looks like this
_PROBE = [_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}]  # the dummy exchange


class ChatRenderer:
    """Token ids of a conversation's opening and of the messages appended after each reply.

    `end_of_turn` is the token that closes an assistant turn (the model's stop token); it must be one
    token the tokenizer treats as special, so that tokenizing what follows it alone gives the same ids
    as inside the whole conversation."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "multi-turn environments need a tokenizer with a chat template (tokenizer.chat_template); "
                "use a chat model's tokenizer, or model name 'tiny-chat' for the built-in one"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._probe = self._text(_PROBE, False)
        self.end_of_turn, self._closing_at = self._find_end_of_turn()
        self._reply_at = self._probe.rfind(_PROBE_REPLY)

    def _text(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _find_end_of_turn(self) -> tuple[int, int]:
        """The id closing an assistant turn, and where the dummy exchange's text ends after it."""
        text = self._probe
        at = text.rfind(_PROBE_REPLY)
        if at < 0:
            raise ValueError("the chat template does not render assistant messages' content; cannot use it")
        after = text[at + len(_PROBE_REPLY) :]
        ids = self._ids(after)
        if not ids:
            raise ValueError(
                "the chat template ends an assistant turn with no token; multi-turn trajectories need one "
                "(e.g. <|im_end|> or the EOS token) to know where a reply ends"
            )
        closing = self.tokenizer.convert_ids_to_tokens(ids[0])
        if ids[0] not in set(self.tokenizer.all_special_ids):
            raise ValueError(
                f"the token closing an assistant turn ({closing!r}) is not a special token, so the ids after "
                "it depend on the text before it; add it to the tokenizer's special tokens"
            )
        return ids[0], at + len(_PROBE_REPLY) + after.index(closing) + len(closing)

    def reply(self, message: Message) -> list[int]:
        """The ids of an assistant message as the model writes it after the generation prompt, through
        the token closing the turn (the supervised warm start's targets)."""
        head = self._text([_PROBE_USER], True)
        text = self._text([_PROBE_USER, message], False)
        if not text.startswith(head):
            raise ValueError(
                "the chat template's generation prompt is not how it starts an assistant message"
            )
        ids = self._ids(text[len(head) :])
        if self.end_of_turn not in ids:
            raise ValueError("the chat template renders an assistant message without closing the turn")
        return ids[: ids.index(self.end_of_turn) + 1]

    def conversation(self, messages: list[Message]) -> tuple[list[int], list[int], list[int]]:
        """A whole conversation as (opening ids, the rest, mask: 1 on the assistant's tokens), built the
        way a trajectory is: opening, then each reply, then the ids of the messages that follow it."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or messages[-1]["role"] != "assistant":
            raise ValueError("a demonstration needs assistant messages and must end with one")
        prompt, rest, mask = self.prompt(messages[:first]), [], []
        i = first
        while i < len(messages):
            j = i + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            ids = self.reply(messages[i])
            rest, mask = rest + ids, mask + [1] * len(ids)
            if j > i + 1:
                obs = self.observation(messages[i + 1 : j])
                rest, mask = rest + obs, mask + [0] * len(obs)
            i = j
        return prompt, rest, mask

    def prompt(self, messages: list[Message]) -> list[int]:
        """The ids of the opening messages, ending with the assistant's generation prompt."""
        if not messages:
            raise ValueError("an environment's reset() returned no messages; return at least the user's one")
        return self._ids(self._text(messages, True))

    def observation(self, messages: list[Message]) -> list[int]:
        """The ids that follow a closed reply: `messages` rendered after a dummy exchange, from just
        past the token closing the dummy reply up to the next generation prompt included."""
        if not messages:
            raise ValueError("an environment step returned no messages and did not end the episode")
        text = self._text(_PROBE + list(messages), True)
        at = text.find(_PROBE_REPLY)
        turn_end = self._probe[self._reply_at : self._closing_at]  # the reply through its closing token
        before, alone = text[:at], self._probe[: self._reply_at]
        if (
            at < 0
            or not text.startswith(turn_end, at)
            or not (alone.startswith(before) or before.startswith(alone))
        ):
            shown = text[: at + len(turn_end)] if at >= 0 else text
            raise ValueError(
                f"the chat template renders the dummy exchange {_PROBE!r} as {self._probe[: self._closing_at]!r} "
                f"alone but as {shown!r} when more messages follow: the reply and the token closing it must "
                "be the same, and the text before it may differ only by a block one rendering adds (as "
                "Qwen3's empty <think></think> before the last reply); use a template that renders a "
                "finished assistant turn the same way whatever follows it"
            )
        return self._ids(text[at + len(turn_end) :])
