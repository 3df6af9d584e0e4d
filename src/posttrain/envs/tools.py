"""Tools: typed Python callables the model calls by name, the parsers that read its calls, and
`ToolEnvironment`, the base of environments whose turns are tool calls.

A tool is a plain or `async def` function with type hints and a Google-style docstring; its JSON
schema comes from `transformers.utils.get_json_schema` (the form chat templates take as `tools=`).
The model's calls are read from its text by a parser: `hermes` reads `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` (Hermes, Qwen2.5/Qwen3); any other parser is a function
`text -> list[ToolCall]` given by import path ('my_pkg.parsers:parse'). A call that cannot be parsed,
names an unknown tool, has wrong arguments or raises gets an error message back (the model sees it and
may try again); it never crashes the episode. A tool that hangs is cut by the environment step's
timeout (`EnvLimits.step_timeout_s`) and fails its trajectory.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from posttrain.envs.base import AssistantMessage, Environment, EnvSample, EnvStep, Message, ToolCall
from posttrain.tasks.rewards import load_callable


@dataclass
class Tool:
    """A callable with its JSON schema (`{"type": "function", "function": {...}}`)."""

    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        """The tool of a typed, documented function (ValueError naming what is missing otherwise)."""
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers raises its own error types for missing hints or docs
            raise ValueError(
                f"tool {getattr(fn, '__name__', fn)!r} needs type hints on every argument and a Google-style "
                f"docstring with an Args: section describing each one ({e})"
            ) from e
        return cls(fn, schema)

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """Why `arguments` do not fit the schema (missing or unknown names), or None."""
        params = self.schema["function"].get("parameters", {})
        known = set(params.get("properties", {}))
        missing = [p for p in params.get("required", []) if p not in arguments]
        unknown = [a for a in arguments if a not in known]
        if missing:
            return f"missing argument(s) {', '.join(missing)} for tool {self.name}"
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)} for tool {self.name} (it takes {sorted(known)})"
        return None

    async def acall(self, arguments: dict[str, Any]) -> Any:
        """Run the tool (a plain function on a daemon thread, so the event loop keeps serving other
        trajectories, and a tool that never returns is abandoned at the step's timeout)."""
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**arguments)
        return await daemon_call(self.fn, **arguments)


def daemon_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
    """`fn(*args, **kwargs)` on a daemon thread, as a future of the running loop. Unlike
    `asyncio.to_thread` (the loop's executor, joined when `asyncio.run` ends), a call that never
    returns leaves nothing to wait for: its timeout abandons it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not fut.done():
            setter(value)

    def hand_back(setter: Callable[[Any], None], value: Any) -> None:
        try:
            loop.call_soon_threadsafe(settle, setter, value)
        except RuntimeError:  # the loop closed while the call ran: it was abandoned, nobody waits
            pass

    def run() -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            hand_back(fut.set_exception, e)
        else:
            hand_back(fut.set_result, value)

    threading.Thread(target=run, daemon=True, name=f"env-{getattr(fn, '__name__', 'call')}").start()
    return fut


def as_tools(tools: list[Any]) -> list[Tool]:
    """`Tool`s of a list of tools or typed functions."""
    return [t if isinstance(t, Tool) else Tool.from_function(t) for t in tools]


# --------------------------------------------------------------------------- parsers

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a body that is not
    such JSON is a call with `error` set (an unclosed last call is read up to the end of the text)."""
    calls = []
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"the tool call is not valid JSON ({e.msg})", text=body))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            error = 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'
            calls.append(ToolCall(None, error=error, text=body))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(
                ToolCall(data["name"], error="the tool call's arguments must be an object", text=body)
            )
            continue
        calls.append(ToolCall(data["name"], arguments, text=body))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


def load_parser(name: str) -> Callable[[str], list[ToolCall]]:
    """A parser by name (see PARSERS) or by import path 'package.module:function'."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown tool parser {name!r}: use one of {sorted(PARSERS)} or 'package.module:function'"
        )
    return load_callable(name, "tool parser", "a function text -> list[ToolCall]")


# --------------------------------------------------------------------------- running calls


def _render_result(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


async def run_tool_calls(calls: list[ToolCall], tools: list[Tool]) -> tuple[list[Message], int]:
    """One `tool` message per call, in order (an error message for a call that failed), and how many
    calls failed. Calls run concurrently."""
    by_name = {t.name: t for t in tools}

    async def one(call: ToolCall) -> tuple[str, bool]:
        if call.error is not None:
            return f"error: {call.error}", False
        tool = by_name.get(call.name or "")
        if tool is None:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(sorted(by_name))}", False
        problem = tool.check_arguments(call.arguments)
        if problem is not None:
            return f"error: {problem}", False
        try:
            return _render_result(await tool.acall(call.arguments)), True
        except Exception as e:  # the tool's own failure is the model's to see, not the episode's end
            return f"error: {type(e).__name__}: {e}", False

    done = await asyncio.gather(*(one(c) for c in calls))
    messages = [{"role": "tool", "name": c.name or "", "content": text} for c, (text, _) in zip(calls, done)]
    return messages, sum(not ok for _, ok in done)


class ToolEnvironment(Environment):
    """An environment whose turns are tool calls: a reply with calls gets their results; a reply
    without calls is the final answer, scored by `finish`. Subclasses set `tools` and implement
    `reset` and `finish`."""

    tools: list[Any] = []

    def __init__(self, sample: EnvSample) -> None:
        super().__init__(sample)
        self._tools = as_tools(self.tools)
        self.num_tool_calls = 0
        self.num_tool_errors = 0

    async def step(self, message: AssistantMessage) -> EnvStep:
        if not message.tool_calls:
            result = self.finish(message)
            result.info.setdefault("tool_errors", float(self.num_tool_errors))  # calls: env/tool_calls
            return result
        messages, errors = await run_tool_calls(message.tool_calls, self._tools)
        self.num_tool_calls += len(message.tool_calls)
        self.num_tool_errors += errors
        return EnvStep(messages=messages)

    def finish(self, message: AssistantMessage) -> EnvStep:
        """The episode's end once the model answers without a tool call: reward (and success)."""
        raise NotImplementedError("a ToolEnvironment subclass implements finish()")
