"""Test-only fault injection for the engine model, switched on by an environment variable.

    INFLIGHT_TEST_FAULT="step:<token id>,fatal:<token id>"

`step:T` makes every engine step that schedules a prompt containing token T raise, so the
requests of that step fail and the engine carries on; `fatal:T` raises `EngineFatalError`, after
which the engine stops for good and the model unloads itself. Never set it in production.
"""

from __future__ import annotations

from inflight.core.outputs import SchedulerOutput
from inflight.fatal_errors import EngineFatalError

ENV_VAR = "INFLIGHT_TEST_FAULT"


def install_test_hook(engine, spec: str | None) -> None:
    """Arm `spec` on an `LLMEngine` (the engine process's, or an in-process executor's)."""
    if not spec:
        return
    triggers: dict[str, set[int]] = {"step": set(), "fatal": set()}
    for item in spec.split(","):
        kind, _, token = item.partition(":")
        if kind not in triggers or not token.strip().isdigit():
            raise ValueError(f"{ENV_VAR}: expected 'step:<id>' or 'fatal:<id>' items, got '{item}'")
        triggers[kind].add(int(token))

    def hook(batch: SchedulerOutput) -> None:
        prompt_ids = {t for s in batch.scheduled for t in s.seq.prompt_token_ids}
        if prompt_ids & triggers["fatal"]:
            raise EngineFatalError("injected fatal fault")
        if prompt_ids & triggers["step"]:
            raise RuntimeError("injected step fault")

    engine.fault_hook = hook
