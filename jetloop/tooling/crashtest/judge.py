"""The verdict of a crash test, read from the tool ledger and the events, never from logs.

Per tool: ``invocations`` (ledger rows: every time its function started), ``calls`` (the
calls of it the model asked for), ``repeated_calls`` (calls whose function started more than
once, with their idempotency keys), ``outcome_unknown`` (and why), and writes recorded
``succeeded`` with no invocation at all. Per run: ``lost`` turns (not ended within the
deadline, or failed or cancelled where the clean conversation completed),
``duplicated_answers`` (a turn that completed more than once), ``verdict``.

The verdict fails on a lost turn, a duplicated answer, a write recorded done that never ran,
a ``NON_IDEMPOTENT_WRITE`` made twice, and an ``IDEMPOTENT_WRITE`` made twice unless its
vendor is said to dedupe on the key (``vendor_dedupes``): the ledger sees invocations, not
their effects, so only the user can vouch for that. Reads may repeat, but each one made
again is said (``warnings``): a tool declared ``READ`` that writes (appends to a file, posts
a message) is the likeliest mistake a crash test exists to catch, and the ledger cannot see
it either; ``pure`` lists the reads the user vouches change nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from jetloop.agents.agent import App
from jetloop.agents.tools import Effect
from jetloop.schemas import EventType
from jetloop.tooling.crashtest.ledger import NOT_SENT, Invocation, call_key_of


@dataclass
class TurnSeen:
    session: str
    turn_id: str
    text: str
    status: str | None = None  # completed, failed, cancelled; None: did not end in time
    error: str | None = None


@dataclass
class Round:
    session: str
    mode: str
    boundary: str | None  # None: a kill at a random moment
    killed_at: float | None = None
    missed: bool = False  # the boundary was not reached this time: nothing was killed
    turns: list[TurnSeen] = field(default_factory=list)


@dataclass
class ToolReport:
    tool: str
    effect: str
    invocations: int = 0
    calls: int = 0
    repeated_calls: int = 0
    repeated: list[dict[str, Any]] = field(default_factory=list)  # call, keys, invocations
    outcome_unknown: int = 0
    unknown: list[dict[str, Any]] = field(default_factory=list)  # call, why
    succeeded_without_invocation: list[str] = field(default_factory=list)
    vendor_dedupes: bool = False
    not_sent: int = 0  # invocations whose call could not be sent (nothing ran)
    pure: bool = False  # a READ the user vouches changes nothing (its repeats are not said)


@dataclass
class CrashReport:
    app: str
    mode: str
    seed: int
    quick: bool
    boundaries: list[str]  # every boundary the clean conversation reached
    rounds: list[Round]
    tools: dict[str, ToolReport]
    lost: list[str]
    duplicated_answers: list[str]
    failures: list[str]  # why the verdict is fail (empty: pass)
    warnings: list[str]  # what passed only if the user's word holds (a read made again)
    seconds: float
    workers: int  # worker processes started

    @property
    def verdict(self) -> str:
        return "fail" if self.failures else "pass"

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict
        return data


def judge(
    *,
    app: str,
    loaded: App,
    mode: str,
    seed: int,
    quick: bool,
    boundaries: list[str],
    clean: Sequence[TurnSeen],
    rounds: list[Round],
    invocations: list[Invocation],
    events: list[tuple[str, dict[str, Any]]],
    vendor_dedupes: set[str],
    seconds: float,
    pure: set[str] = frozenset(),  # type: ignore[assignment]
    workers: int,
) -> CrashReport:
    tools: dict[str, ToolReport] = {}
    for agent in loaded.agents.values():
        for declared in agent.tools:
            tools.setdefault(declared.name, ToolReport(declared.name, declared.effect.value))
    by_call: dict[str, list[Invocation]] = defaultdict(list)
    for inv in invocations:
        rep = tools.setdefault(inv.tool, ToolReport(inv.tool, inv.effect))
        if (inv.outcome or "").startswith(NOT_SENT):
            rep.not_sent += 1  # the call never reached the vendor: nothing ran, no repeat
            continue
        rep.invocations += 1
        by_call[call_key_of(inv)].append(inv)
    calls: dict[str, set[str]] = defaultdict(set)
    for key, invs in by_call.items():
        calls[invs[0].tool].add(key)
    completed: Counter[str] = Counter()
    for kind, data in events:
        if kind == EventType.TURN_COMPLETED.value:
            completed[f"{data['session']}/{data['turn']}"] += 1
            continue
        tool, key, state = str(data["tool"]), str(data["call_key"]), str(data["state"])
        rep = tools.setdefault(tool, ToolReport(tool, str(data.get("effect", ""))))
        calls[tool].add(key)
        if state == "outcome_unknown":
            rep.outcome_unknown += 1
            why = data.get("error") or data.get("settlement") or ""
            rep.unknown.append({"call": key, "why": why})
        if state == "succeeded" and rep.effect != Effect.READ.value and key not in by_call:
            rep.succeeded_without_invocation.append(key)
    for tool, keys in calls.items():
        tools[tool].calls = len(keys)
    for key, invs in by_call.items():
        if len(invs) > 1:
            rep = tools[invs[0].tool]
            rep.repeated_calls += 1
            rep.repeated.append(
                {
                    "call": key,
                    "invocations": len(invs),
                    "keys": sorted({i.idempotency_key for i in invs}),
                    "attempts": [i.attempt for i in invs],
                    "ended": [i.outcome for i in invs],
                }
            )
    for name in vendor_dedupes:
        if name in tools:
            tools[name].vendor_dedupes = True
    for name in pure:
        if name in tools:
            tools[name].pure = True
    warnings = [
        f"{rep.tool} (read) was made again in {rep.repeated_calls} calls: safe only if it "
        "changes nothing; a tool that writes must not be declared read (say --pure "
        f"{rep.tool} if it only reads)"
        for rep in tools.values()
        if rep.repeated_calls and rep.effect == Effect.READ.value and not rep.pure
    ]

    failures: list[str] = []
    completes = {t.text for t in clean if t.status == "completed"}
    for t in clean:
        if t.status != "completed":
            failures.append(
                f"without any crash, the turn of {t.text!r} ended {t.status or 'not at all'}"
                f" ({t.error}): a crash test needs a conversation that completes"
            )
    lost = [
        f"{r.boundary or 'random kill'}: {t.session}/{t.turn_id} ({t.text!r})"
        f" {t.status or 'did not end'}{': ' + t.error if t.error else ''}"
        for r in rounds
        for t in r.turns
        if t.status is None or (t.status != "completed" and t.text in completes)
    ]
    if lost:
        failures.append(f"{len(lost)} turns lost")
    twice = sorted(k for k, n in completed.items() if n > 1)
    if twice:
        failures.append(f"{len(twice)} answers delivered more than once")
    for rep in tools.values():
        if rep.succeeded_without_invocation:
            failures.append(
                f"{rep.tool}: {len(rep.succeeded_without_invocation)} calls recorded succeeded"
                " that never ran"
            )
        if not rep.repeated_calls:
            continue
        if rep.effect == Effect.NON_IDEMPOTENT_WRITE.value:
            failures.append(
                f"{rep.tool} (non_idempotent_write) ran {rep.repeated_calls} calls more than once"
            )
        elif rep.effect == Effect.IDEMPOTENT_WRITE.value and not rep.vendor_dedupes:
            failures.append(
                f"{rep.tool} (idempotent_write) ran {rep.repeated_calls} calls more than once"
                " with the same key: safe only if the vendor dedupes on it (say so with"
                f" --vendor-dedupes {rep.tool}, or declare it non_idempotent_write)"
            )
    return CrashReport(
        app=app,
        mode=mode,
        seed=seed,
        quick=quick,
        boundaries=boundaries,
        rounds=rounds,
        tools=tools,
        lost=lost,
        duplicated_answers=twice,
        failures=failures,
        warnings=warnings,
        seconds=seconds,
        workers=workers,
    )


def format_report(rep: CrashReport) -> str:
    hit = [r for r in rep.rounds if not r.missed]
    missed = [r for r in rep.rounds if r.missed]
    kills = len({r.killed_at for r in hit if r.killed_at is not None})
    what = "worker kills" if rep.mode == "worker_kill" else "server restarts"
    lines = [
        f"crash test of {rep.app} ({rep.mode}, seed {rep.seed}{', quick' if rep.quick else ''}):"
        f" {len(rep.boundaries)} step boundaries found;"
        f" {sum(1 for r in hit if r.boundary)} sessions caught at a boundary and"
        f" {sum(1 for r in hit if not r.boundary)} at a random moment, by {kills} {what};"
        f" {len(missed)} boundaries not reached again; {rep.seconds:.0f}s",
        "",
        f"{'tool':<24}{'effect':<22}{'invocations':>12}{'calls':>7}{'repeated':>10}{'unknown':>9}",
    ]
    for t in sorted(rep.tools.values(), key=lambda t: t.tool):
        note = ""
        if t.repeated_calls and t.effect == Effect.IDEMPOTENT_WRITE.value:
            note = "  same key: safe only if the vendor dedupes on it" + (
                " (it does, you said)" if t.vendor_dedupes else ""
            )
        elif t.repeated_calls and t.effect == Effect.READ.value:
            note = "  made again: safe only if it changes nothing" + (
                " (it does not, you said)" if t.pure else ""
            )
        lines.append(
            f"{t.tool:<24}{t.effect:<22}{t.invocations:>12}{t.calls:>7}{t.repeated_calls:>10}"
            f"{t.outcome_unknown:>9}{note}"
        )
        for u in t.unknown[:3]:
            lines.append(f"    outcome_unknown {u['call']}: {u['why']}")
    lines.append("")
    lines.append(
        f"lost turns: {len(rep.lost)}   answers delivered twice: {len(rep.duplicated_answers)}"
    )
    for what in rep.lost:
        lines.append(f"  LOST {what}")
    for what in rep.warnings:
        lines.append(f"  WARN {what}")
    for what in rep.failures:
        lines.append(f"  FAIL {what}")
    lines.append(f"verdict: {rep.verdict}")
    return "\n".join(lines)
