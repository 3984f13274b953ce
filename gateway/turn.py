"""One chat turn, from the moment its session is locked to the moment it ends, exactly once.

A turn is one transaction. Admission works on the KV cache and collects the turn's ledger rows
in memory; before generation they are written in one ledger transaction together with what the
turn owes (its audit records, the forgets of what the policy admitted for this turn only), as
intents that survive a crash (gateway/erasure.py). At its end a turn that generated (to the end,
or until its client left) is committed: its audit records are appended, then its forgets and
amortizations done, audited. A turn that failed anywhere, generation included, or whose audit
records cannot be written, is rolled back: `end` puts the cache and the ledger (rows and intents)
back exactly as they were. `end` is the only place that rolls back.

The caller holds the session lock around the whole turn in one synchronous block
(`Gateway.run_turn`), so no cancellation, disconnect or generator that is never resumed can skip
`end` or keep the lock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from ledger import NewSegment, TurnWrite

from .sessions import LiveSession

log = structlog.get_logger(__name__)


@dataclass
class Action:
    """What happened to one tool result, as reported to the client (indices are the client's)."""

    message_index: int
    segment_id: str | None
    tool: str | None
    action: str
    reasons: tuple[str, ...]
    gate: dict[str, Any]
    audit_index: int | None = None
    overhead_ms: float = 0.0  # gate + policy + ledger + audit, model compute excluded
    channel: str = "tool"  # the decision policy's input.channel

    def to_dict(self) -> dict[str, Any]:
        return {"message_index": self.message_index, "segment_id": self.segment_id, "tool": self.tool,
                "action": self.action, "reasons": list(self.reasons), "gate": self.gate,
                "audit_index": self.audit_index, "overhead_ms": round(self.overhead_ms, 3),
                "channel": self.channel}


@dataclass
class Staged:
    """One new message of the turn: the ledger row it will be, and for a tool result its action."""

    row: NewSegment
    action: Action | None = None
    stub: tuple[int, ...] = ()  # what an amortize splices in
    audit: dict[str, Any] | None = None  # the quarantine record's body, less segment id and span


@dataclass
class Turn:
    live: LiveSession
    before: list[int]  # the cache's tokens when the turn began: what a rollback restores
    staged: list[Staged] = field(default_factory=list)
    keep: int = 0  # conversation segments the request matched; the rest leave the conversation
    write: TurnWrite | None = None  # the ledger transaction (rows and intents), once written
    committed: bool = False  # its audit records are in: the turn stands
    prompt_tokens: int = 0
    outcome: str = "open"
    erasures: list[dict[str, Any]] = field(default_factory=list)
    abandoned: Callable[[], bool] = lambda: False  # the client left or the gateway is stopping

    @property
    def session_id(self) -> str:
        return self.live.record.id

    @property
    def actions(self) -> list[Action]:
        return [s.action for s in self.staged if s.action is not None]

    def end(self, outcome: str, ops: "TurnOps") -> list[dict[str, Any]]:
        """End the turn (once): drop the generation; commit a turn that generated, or roll back one
        that failed; then run the committed one's post-turn erasures. Returns those erasures."""
        if self.outcome != "open":
            return self.erasures
        self.outcome = outcome
        try:
            ops.drop_generation(self)
            if self.write is not None and outcome != "failed":
                ops.commit(self)
                self.committed = True
        finally:
            if not self.committed:
                ops.restore(self)
                log.info("turn.rolled_back", session=self.session_id, outcome=outcome)
        self.erasures = ops.post_turn(self)
        log.info("turn.ended", session=self.session_id, outcome=outcome, erasures=len(self.erasures))
        return self.erasures


class TurnOps(Protocol):
    def drop_generation(self, turn: Turn) -> None:
        """Roll the staged generation prompt and the generated tokens out of the cache."""

    def commit(self, turn: Turn) -> None:
        """Append the turn's audit records (its ledger rows are written): the turn stands."""

    def restore(self, turn: Turn) -> None:
        """Undo the turn's ledger write (rows and intents, if any) and put the cache back to `turn.before`."""

    def post_turn(self, turn: Turn) -> list[dict[str, Any]]:
        """Forget or amortize what the policy admitted for this turn only (and what the session
        still owes from before), audited."""
