"""Worker phases as a state machine (DESIGN.md, "Worker phases").

Every worker verb declares the phases it accepts with `@verb(...)`. A call in the wrong phase raises
`PhaseError` naming the verb, the current phase and the exact call that fixes it, before the verb's
body runs (so nothing touches the device). Two further switches are checked the same way: an open
split train step pins the worker (no phase change until finish/abort), and torn-down communicators
block every verb that needs a collective until `rebuild_comms()`.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Phase(str, enum.Enum):
    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"
    OFFLOADED = "OFFLOADED"


class PhaseError(RuntimeError):
    """A verb was called in a state that does not allow it; the message says which call fixes it."""


# The call that brings a worker into each phase.
FIX_FOR_PHASE = {
    Phase.TRAINING: "prepare_for_training()",
    Phase.INFERENCE: "prepare_for_lp_inference()",
    Phase.OFFLOADED: "offload_after_refit()",
}

TRAIN_ONLY = (Phase.TRAINING,)
ON_DEVICE = (Phase.TRAINING, Phase.INFERENCE)
ANY_PHASE = (Phase.TRAINING, Phase.INFERENCE, Phase.OFFLOADED)


class Lifecycle:
    """The state a worker (or the driver-side Policy, for all ranks) is in."""

    def __init__(self, phase: Phase = Phase.TRAINING) -> None:
        self.phase = phase
        self.step_open = False
        self.comms_up = True

    def check(
        self, verb: str, allowed: tuple[Phase, ...], collective: bool, transition: bool, in_step: bool
    ) -> None:
        """Raise PhaseError if `verb` may not run now."""
        if transition and self.step_open:
            raise PhaseError(
                f"{verb}() called while a split train step is open (phase {self.phase.value}); "
                "call finish_train_step() or abort_train_step() first"
            )
        if self.phase not in allowed:
            fix = FIX_FOR_PHASE[Phase.INFERENCE if Phase.INFERENCE in allowed else Phase.TRAINING]
            raise PhaseError(
                f"{verb}() needs phase {' or '.join(p.value for p in allowed)} but the worker is "
                f"{self.phase.value}; call {fix} first"
            )
        if collective and not self.comms_up:
            raise PhaseError(
                f"{verb}() needs the worker's communicators but they are torn down; call rebuild_comms() first"
            )
        if in_step and not self.step_open:
            raise PhaseError(
                f"{verb}() called without an open train step; call begin_train_step(loss_fn) first"
            )

    def snapshot(self) -> dict[str, Any]:
        return {"phase": self.phase.value, "step_open": self.step_open, "comms_up": self.comms_up}


def verb(
    *allowed: Phase, collective: bool = False, transition: bool = False, in_step: bool = False
) -> Callable[[F], F]:
    """Declare the phases a worker method accepts. The instance must have a `lifecycle` attribute.

    collective: the verb runs a collective (blocked while communicators are torn down).
    transition: the verb changes the phase (blocked while a split train step is open).
    in_step: the verb needs an open split train step.
    """
    phases = allowed or ANY_PHASE

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            self.lifecycle.check(fn.__name__, phases, collective, transition, in_step)
            return fn(self, *args, **kwargs)

        wrapper.__phases__ = phases  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return deco
