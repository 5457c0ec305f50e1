"""The mutation check: deliberate bugs in the engine, and the tests that must catch them.

Each ``Mutation`` names a file of the engine (under ``jetloop/consumers/``, ``jetloop/sessions/`` or
``jetloop/streams/``), an exact source snippet, what replaces it, the bug that makes in one
line, and the test node ids that claim to catch it. ``check`` copies the project to a temporary
directory, applies the one mutation there (failing loudly unless the snippet is found exactly
once, so the list cannot rot silently), checks that a fresh interpreter with the copy first on
``PYTHONPATH`` — which is what the worker subprocesses the tests start inherit — imports the
mutated module from the copy, runs the named tests in the copy, and reports the mutation caught
(a test failed) or survived (every test passed).

    python -m tests.mutations                 # the CI subset
    python -m tests.mutations --all           # every mutation (see docs/crash-matrix.md)
    python -m tests.mutations approval-gate-passes-while-pending ...
    python -m tests.mutations --all --each    # run every named test, not only up to the first
                                              # failure: which tests catch what
    python -m tests.mutations --list

It exits non-zero if any mutation survives or cannot be applied. ``tests/test_mutations.py``
runs the CI subset inside the test suite and checks that every snippet still applies.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IGNORED = (".git", ".venv", ".pytest_cache", ".mypy_cache", ".ruff_cache")
MATRIX = "tests/test_matrix.py::test_matrix"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # under jetloop/consumers/, jetloop/sessions/ or jetloop/streams/
    find: str  # exact source, found exactly once
    replace: str
    bug: str  # the bug the replacement makes, in one line
    tests: tuple[str, ...]  # node ids that claim to catch it

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


def cell(column: str, row: str) -> str:
    return f"{MATRIX}[{column}-{row}]"


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "dispatch-acks-when-lost",
        "jetloop/consumers/dispatch.py",
        '        if d.lost:\n            raise TakenOver(d.fence_key or "?")\n'
        "        await _let_go(rt, msg)\n",
        "        await _let_go(rt, msg)\n",
        "dispatch acks a step whose lease was lost (d.lost ignored)",
        ("tests/test_crash.py::test_stalled_worker_after_its_commit_acks_nothing",),
    ),
    Mutation(
        "dispatch-settles-taken-over",
        "jetloop/consumers/dispatch.py",
        '        log.warning("step.taken_over", key=exc.key)\n',
        '        log.warning("step.taken_over", key=exc.key)\n        await _quietly(msg.nak())\n',
        "a taken-over attempt naks its message (sends something on it)",
        ("tests/test_crash.py::test_stalled_worker_writes_and_acks_nothing",),
    ),
    Mutation(
        "no-fence-check-before-the-tool",
        "jetloop/consumers/call_tool.py",
        "    if not await env.d.still_ours(fresh_for=rt.lease_seconds / 4):\n",
        "    if False:\n",
        "the fence check before the tool call is removed",
        (
            "tests/test_crash.py::test_stalled_worker_writes_and_acks_nothing",
            cell("worker_kill", "single_attempt-after-mark"),
        ),
    ),
    Mutation(
        "no-fence-check-before-the-model-call",
        "jetloop/consumers/run_model.py",
        "    if not await d.still_ours(fresh_for=rt.lease_seconds / 4):\n",
        "    if False:\n",
        "the fence check before the model call is removed (a stalled worker asks the model again)",
        ("tests/test_crash.py::test_stalled_worker_makes_no_model_call_after_a_takeover",),
    ),
    Mutation(
        "unstarted-model-attempt-counted",
        "jetloop/consumers/run_model.py",
        "    again = resumed is not None and await own_unstarted(d, turn_key(sid, tid), resumed)\n",
        "    again = False\n",
        "an attempt of this process that never called the model is taken over and counted",
        (
            "tests/test_resume.py::"
            "test_a_model_attempt_its_own_worker_never_began_is_continued_not_counted",
        ),
    ),
    Mutation(
        "unstarted-write-left-in-doubt",
        "jetloop/consumers/call_tool.py",
        "        and env.takeover == Takeover.ABANDONED\n",
        "        and False\n",
        "a single-attempt write this process marked and never began is settled in doubt",
        (
            "tests/test_resume.py::"
            "test_a_write_its_own_worker_marked_and_never_began_is_made_not_left_in_doubt",
        ),
    ),
    Mutation(
        "no-fence-check-before-the-summary-call",
        "jetloop/consumers/compact.py",
        "        if not await d.still_ours(fresh_for=rt.lease_seconds / 4):\n",
        "        if False:\n",
        "the fence check before a compaction's summary call is removed",
        ("tests/test_crash.py::test_stalled_worker_makes_no_summary_call_after_a_takeover",),
    ),
    Mutation(
        "model-call-not-cancelled-when-lost",
        "jetloop/consumers/runtime.py",
        '                paid.cancel("the step was taken over")\n',
        "                pass\n",
        "a heartbeat that finds the claim lost lets the model call in flight run on",
        (
            "tests/test_crash.py::test_model_call_in_flight_is_cancelled_when_the_claim_is_found_lost",
        ),
    ),
    Mutation(
        "approval-gate-passes-while-pending",
        "jetloop/consumers/approvals.py",
        "    if approval.status == Decision.PENDING:\n",
        "    if approval.status == Decision.PENDING and False:\n",
        "the approval gate passes while the approval is pending",
        (
            cell("worker_kill", "approval-while-waiting"),
            cell("server_restart", "approval-while-waiting"),
            cell("takeover", "approval-while-waiting"),
            "tests/test_steps.py::test_approval_while_no_worker_runs_and_policy_overrides",
            "tests/test_resume.py::test_gates_again_on_resume",
        ),
    ),
    Mutation(
        "lost-write-recorded-succeeded",
        "jetloop/consumers/call_tool.py",
        '        log.info("call.resume", settlement="made again with the same idempotency key")\n'
        '        return "made again"\n',
        '        await settle(env, CallOutcome(state=CallState.SUCCEEDED), "made again")\n'
        '        return "settled"\n',
        "a lost idempotent write is recorded succeeded without being made again",
        (
            cell("worker_kill", "idempotent_write-while-running"),
            "tests/test_resume.py::test_one_worker_lost_is_one_loss",
        ),
    ),
    Mutation(
        "single-attempt-write-marked-running",
        "jetloop/consumers/call_tool.py",
        '            "state": CallState.IN_DOUBT if effect.is_write else CallState.RUNNING,\n',
        '            "state": CallState.RUNNING,\n',
        "a single-attempt write is marked RUNNING instead of in doubt",
        (
            cell("worker_kill", "single_attempt-while-running"),
            cell("worker_kill", "single_attempt-after-mark"),
            cell("server_restart", "single_attempt-while-running"),
            cell("server_restart", "single_attempt-after-mark"),
            cell("takeover", "single_attempt-while-running"),
        ),
    ),
    Mutation(
        "idempotency-key-per-attempt",
        "jetloop/consumers/calls.py",
        "        return self._call.idempotency_key\n",
        '        return f"{self._call.idempotency_key}.a{self._attempt}"\n',
        "the idempotency key includes the attempt number",
        (
            cell("worker_kill", "idempotent_write-while-running"),
            "tests/test_lifecycle.py::test_drain_timeout_hands_the_step_back",
        ),
    ),
    Mutation(
        "no-commit-time-fence",
        "jetloop/consumers/runtime.py",
        "            if self.lost:\n"
        "                raise TakenOver(self.fence_key)\n"
        "            try:\n"
        "                rev = await self.rt.state.write(self.fence_key, value, self.fence_rev)\n",
        "            try:\n"
        "                now = await self.rt.state.revision(self.fence_key)\n"
        "                rev = await self.rt.state.write(self.fence_key, value, now)\n",
        "a commit writes over whatever the key holds: a stale worker's CAS is not rejected",
        ("tests/test_crash.py::test_stalled_worker_before_its_commit_is_fenced",),
    ),
    Mutation(
        "no-attempt-exhaustion",
        "jetloop/consumers/call_tool.py",
        "    if used >= tool.max_attempts or window_passed(rec, tool):\n",
        "    if False:\n",
        "a call whose attempts ran out is made again instead of settled `exhausted`",
        (
            cell("worker_kill", "every_attempt-read"),
            cell("worker_kill", "every_attempt-write"),
        ),
    ),
    Mutation(
        "no-join-recovery",
        "jetloop/consumers/join.py",
        "        results = _results(calls)\n"
        "        if results is not None:\n"
        "            await joined(turn, results, folded=rt.folded_log).publish(rt.bus)\n"
        "        return\n",
        "        return\n",
        "a join redelivered after its worker moved the turn and died does not publish what follows",
        ("tests/test_resume.py::test_join_lost_before_publishing_is_published_again",),
    ),
    Mutation(
        "no-read-back-of-a-lost-reply",
        "jetloop/streams/state.py",
        "            return entry.revision if entry.value in sent and entry.revision else None\n",
        "            return None\n",
        "a state write whose reply was lost is not read back (a retried CAS looks like a takeover)",
        ("tests/test_crash.py::test_write_whose_reply_was_lost_is_read_back",),
    ),
    Mutation(
        "no-re-emit-on-redelivery",
        "jetloop/consumers/run_model.py",
        "    if turn.model_step == n and turn.phase == TurnPhase.CALLS:\n"
        "        # The usage told again goes out with the answer's records, before its calls.\n"
        "        told = Followers(usage_again(rt, turn))\n"
        "        await (told + answer(turn, rt.calls_in_one_message, folded=rt.folded_log))"
        ".publish(rt.bus)\n"
        "        return\n",
        "    if turn.model_step == n and turn.phase == TurnPhase.CALLS:\n        return\n",
        "a redelivered model step whose answer is committed does not re-emit its calls",
        (cell("worker_kill", "run_model-after-output"),),
    ),
    Mutation(
        "no-outcome-event-once-the-turn-moved-on",
        "jetloop/consumers/call_tool.py",
        "        if current or turn.model_step == n + 1:\n"
        "            await outcome_told_and_joined(d, turn, rec_v.value, n, i, first=False)\n"
        "        else:\n"
        "            await call_done(turn, rec_v.value, folded=rt.folded_log).publish(rt.bus)\n",
        "        if current:\n"
        "            await outcome_told_and_joined(d, turn, rec_v.value, n, i, first=False)\n",
        "a redelivered call whose outcome is committed re-emits nothing once the turn moved on",
        (
            "tests/test_resume.py::"
            "test_outcome_committed_before_its_worker_died_is_told_after_the_turn_moved_on",
        ),
    ),
    Mutation(
        "seal-not-checked",
        "jetloop/streams/state.py",
        "                raise SealBroken(key, why)\n",
        "                pass\n",
        "a checkpoint whose seal does not verify is trusted",
        ("tests/test_resume.py::test_tampered_checkpoint_is_not_run",),
    ),
    Mutation(
        "seal-not-bound-to-key",
        "jetloop/streams/seal.py",
        '    return DOMAIN + key.encode() + b"\\n" + str(at_ms).encode()'
        ' + b"\\n%d\\n" % replaces + body\n',
        '    return DOMAIN + b"\\n" + str(at_ms).encode() + b"\\n%d\\n" % replaces + body\n',
        "a sealed record copied to another key (another call, another session) is trusted",
        ("tests/test_seal_binding.py::test_a_record_copied_from_another_key_is_refused",),
    ),
    Mutation(
        "seal-time-not-checked",
        "jetloop/streams/seal.py",
        "        if abs(stored_at - sealed_at) > self.tolerance:\n",
        "        if False:\n",
        "a record sealed far from the time it was stored (a clock off, or a state put back "
        "over the revision it was sealed for) is trusted",
        ("tests/test_seal_binding.py::test_seal_binds_key_and_time_and_rotates",),
    ),
    Mutation(
        "seal-revision-not-checked",
        "jetloop/streams/seal.py",
        "        if version == SEAL_VERSION and replaced != int(replaces_text):\n",
        "        if False:\n",
        "an older sealed state put back inside the time tolerance is trusted",
        (
            "tests/test_seal_binding.py::test_a_rejection_cannot_be_undone_inside_the_tolerance",
            "tests/test_seal_binding.py::test_a_session_put_back_inside_the_tolerance_runs_nothing",
        ),
    ),
    Mutation(
        "only-checkpoints-sealed",
        "jetloop/streams/state.py",
        "        if self.sealer is None or not verify:\n",
        "        if self.sealer is None or not verify or model not in (TurnRecord, CallRecord):\n",
        "approval and session records are trusted without their seal (a raw put decides a call)",
        (
            "tests/test_seal_binding.py::test_an_approval_edited_by_a_raw_put_is_not_a_decision",
            "tests/test_seal_binding.py::test_a_session_edited_by_a_raw_put_runs_nothing",
        ),
    ),
    Mutation(
        "live-holder-taken-over",
        "jetloop/consumers/liveness.py",
        "    rt = d.rt\n    if held.incarnation == rt.incarnation:\n",
        "    rt = d.rt\n    return\n    if held.incarnation == rt.incarnation:\n",
        "another delivery of a step takes it over while the attempt holding it lives",
        (
            "tests/test_recovery.py::test_a_holder_past_its_lease_but_beating_is_live",
            "tests/test_recovery.py::test_live_holder_is_never_taken_over",
        ),
    ),
    Mutation(
        "holder-lost-header-trusted",
        "jetloop/consumers/liveness.py",
        "        if await gone(rt.nc, held.incarnation):\n",
        "        if True:\n",
        "a copy whose header says the holder is dead is believed without asking the holder",
        ("tests/test_recovery.py::test_live_holder_is_never_taken_over",),
    ),
    Mutation(
        "sweep-trusts-a-new-link",
        "jetloop/consumers/liveness.py",
        "    while True:\n        linked = linked_for(nc)\n",
        "    return\n    while True:\n        linked = linked_for(nc)\n",
        "a worker that starts just after a server restart takes every live worker still"
        " connecting again for dead",
        ("tests/test_recovery.py::test_a_worker_stopped_across_a_server_restart_keeps_its_step",),
    ),
    Mutation(
        "silence-counted-through-an-outage",
        "jetloop/consumers/liveness.py",
        "    silence = min(time.time() - stored_at, linked)\n",
        "    silence = time.time() - stored_at\n",
        "a holder's silence counts the time no one could hear it (a server restart)",
        ("tests/test_liveness.py::test_silence_counts_from_the_judges_new_link",),
    ),
    Mutation(
        "copy-believed-on-a-new-link",
        "jetloop/consumers/liveness.py",
        "        if linked < RECONNECT_GRACE:\n",
        "        if False:\n",
        "a handed-on copy takes the step of a holder that may still be connecting again",
        ("tests/test_liveness.py::test_a_handed_on_copy_waits_for_the_judges_link_to_settle",),
    ),
    Mutation(
        "heartbeat-only-reads",
        "jetloop/consumers/runtime.py",
        "            await self._rewrite()\n",
        "            pass\n",
        "the heartbeat extends the lease but leaves no sign of life in state",
        ("tests/test_recovery.py::test_a_holder_past_its_lease_but_beating_is_live",),
    ),
    Mutation(
        "heartbeat-rewrites-a-value-read-before-the-lock",
        "jetloop/consumers/runtime.py",
        "        if self.fence_value is not None and not self.lost:\n",
        "        if self.fence_value is not None and not self.lost:\n"
        "            await self.commit(self.fence_value)\n"
        "        if False:\n",
        "a heartbeat that waited behind a commit writes the record as it was before: the "
        "commit is undone",
        ("tests/test_heartbeat.py::test_a_heartbeat_behind_a_slow_commit_writes_the_commit",),
    ),
    Mutation(
        "holds-not-published",
        "jetloop/streams/holds.py",
        "        await self.nc.publish(subject, body, headers=headers)\n",
        "        return\n",
        "nobody knows what a worker held: its steps wait for their leases when it dies",
        (
            "tests/test_recovery.py::test_dead_workers_step_moves_on_at_once",
            "tests/test_recovery.py::test_restarted_worker_hands_on_what_its_predecessor_held",
        ),
    ),
    Mutation(
        "tool-args-shared",
        "jetloop/consumers/calls.py",
        "        return self.tool.args_model.model_validate(copy.deepcopy(self.call.args))\n",
        "        return self.tool.args_model.model_validate(self.call.args)\n",
        "a tool that changes its arguments in place changes what its retry is given (records "
        "are remembered decoded)",
        ("tests/test_steps.py::test_a_retry_is_given_the_checkpointed_arguments",),
    ),
    Mutation(
        "join-unelected",
        "jetloop/consumers/join.py",
        "    if first and own is not None and not _elected(calls, own):\n",
        "    if False:\n",
        "every call that finds all outcomes in races the turn's CAS (a lost write and a read "
        "each), not only the one committed last",
        ("tests/test_join_election.py::test_only_the_call_committed_last_moves_the_turn",),
    ),
    Mutation(
        "reconcile-without-join",
        "jetloop/sessions/decisions.py",
        "            await self._join_after_reconcile(call_key)\n",
        "",
        "a reconcile that lands after the last commit and before its join leaves the turn "
        "unmoved for ever",
        (
            "tests/test_join_election.py::"
            "test_a_reconcile_after_the_last_commit_still_moves_the_turn",
        ),
    ),
    Mutation(
        "history-not-restored",
        "jetloop/consumers/run_model.py",
        "    await rt.bus.publish(records)\n",
        "",
        "a history entry lost with the publish beside its RunModel is never sent again: the "
        "model is asked without it, or the step waits for ever",
        (
            "tests/test_history_inputs.py::test_the_users_message_is_restored_for_model_step_0",
            "tests/test_history_inputs.py::"
            "test_the_previous_steps_results_are_restored_from_the_call_records",
        ),
    ),
    Mutation(
        "read-delivered-again-unclaimed",
        "jetloop/consumers/call_tool.py",
        "    if unclaimed and not env.d.first_sight:\n",
        "    if False:\n",
        "a read delivered again runs unclaimed too: a lost read attempt is never counted, so a "
        "read that kills its worker every time is made for ever",
        (
            "tests/test_crash.py::test_stalled_unclaimed_read_commits_nothing_after_a_takeover",
            "tests/test_matrix.py::test_matrix[worker_kill-every_attempt-read]",
        ),
    ),
    Mutation(
        "usage-keyed-per-step",
        "jetloop/consumers/usage.py",
        "        request.model_step,\n        request.attempt,\n",
        "        request.model_step,\n        1,\n",
        "a model call's usage is keyed by its step, not its attempt: a repeat is dropped",
        ("tests/test_usage.py::test_usage_equals_what_the_provider_billed_across_a_worker_kill",),
    ),
    Mutation(
        "budget-forgets-a-lost-call",
        "jetloop/consumers/run_model.py",
        "        paid = await lost_call(rt.js, sid, tid, n, resumed.no)\n",
        "        paid = None\n",
        "a resumed model step does not add the lost attempt's paid call to the turn's count",
        ("tests/test_usage.py::test_a_crash_does_not_reset_the_count",),
    ),
    Mutation(
        "throttle-uses-an-attempt",
        "jetloop/consumers/run_model.py",
        "            await admission.throttled(exc, wait)\n"
        "            await d.commit(_unused(claimed, used))\n",
        "            await admission.throttled(exc, wait)\n"
        '            await d.commit(claimed.model_copy(update={"attempt": None}))\n',
        "a 429 with Retry-After uses up one of the model step's attempts",
        ("tests/test_usage.py::test_a_429_pauses_every_worker_and_uses_no_attempt",),
    ),
    Mutation(
        "pause-not-shared",
        "jetloop/streams/pauses.py",
        "        if self.kv is None:\n            return\n        body",
        "        if True:\n            return\n        body",
        "a worker throttled by a 429 pauses alone: the others go on calling the provider",
        ("tests/test_usage.py::test_a_429_pauses_every_worker_and_uses_no_attempt",),
    ),
    Mutation(
        "window-tokens-not-checked",
        "jetloop/streams/windows.py",
        "                if tpm is not None and requests and tokens + reserve > tpm:\n",
        "                if False:\n",
        "a window's token limit is not checked: every worker calls as fast as it can",
        ("tests/test_usage.py::test_a_token_limit_per_window_holds_across_two_workers",),
    ),
    Mutation(
        "repeated-attempt-span-not-linked",
        "jetloop/consumers/tracing.py",
        "        if attempt <= 1:\n            return []\n",
        "        if True:\n            return []\n",
        "an attempt made again after a crash is a span with no link to the first attempt's",
        ("tests/test_tracing.py::test_one_trace_across_a_worker_kill",),
    ),
    Mutation(
        "slots-not-taken",
        "jetloop/streams/windows.py",
        "        if self.kv is None or limits.concurrent is None:\n",
        "        if True:\n",
        "an endpoint's concurrency cap is not kept: every worker calls it at once",
        ("tests/test_usage.py::test_calls_in_flight_are_capped_across_two_workers",),
    ),
    Mutation(
        "calls-of-one-message-unbounded",
        "jetloop/consumers/call_tool.py",
        "    slotted = await slots.take(count) if slots is not None else 0\n",
        "    slotted = count if slots is not None else 0\n",
        "the calls of one message run all at once, past the tool pool's concurrency",
        (
            "tests/test_call_tools.py::test_the_tool_pools_concurrency_counts_the_calls_of_one_message",
        ),
    ),
    Mutation(
        "calls-message-acked-though-one-must-wait",
        "jetloop/consumers/call_tool.py",
        "    if waits:\n",
        "    if False:\n",
        "a message of calls is acked while one of its calls waits to be tried again: that call "
        "is never made and its turn never moves",
        ("tests/test_call_tools.py::test_a_call_handed_back_leaves_the_others_made_once",),
    ),
    Mutation(
        "carried-turn-written-since-taken-over",
        "jetloop/consumers/runtime.py",
        "                if carried and self.fence_key is None:\n",
        "                if False:\n",
        "a model step whose carried turn was written since takes the failed claim for a "
        "takeover: it sends nothing, and the turn waits a lease for the message to come back",
        ("tests/test_step_reads.py::test_a_carried_turn_written_since_is_read_again",),
    ),
    Mutation(
        "ended-call-of-a-message-still-beaten",
        "jetloop/consumers/runtime.py",
        "        parts = [p for p in self.parts if not p.ended]\n",
        "        parts = list(self.parts)\n",
        "the heartbeat of a message of calls rewrites the record of a call that began a wait: "
        "the wait's own message commits it, the rewrite fails, and the whole message is taken "
        "for lost (not acked, delivered again)",
        (
            "tests/test_call_tools.py::test_a_call_whose_wait_ends_while_its_siblings_run_still_joins",
        ),
    ),
    Mutation(
        "message-joins-without-a-sibling-that-waited",
        "jetloop/consumers/join.py",
        "        if any(p.ended and i not in self.done for i, p in enumerate(self.parts)):\n",
        "        if False:\n",
        "a call of a message of calls whose sibling began a wait does not join, though that "
        "sibling may have ended by its own message, whose join found this call open: the turn "
        "never moves",
        (
            "tests/test_call_tools.py::test_a_call_whose_wait_ends_while_its_siblings_run_still_joins",
        ),
    ),
    Mutation(
        "carry-used-unverified",
        "jetloop/consumers/carry.py",
        "    if why is not None:\n",
        "    if False:\n",
        "a step message's carried records are used without their seal: whoever may publish "
        "step messages gives a model step a turn of their own, which its claim writes back sealed",
        ("tests/test_step_reads.py::test_a_forged_carry_is_not_used",),
    ),
    Mutation(
        "first-sight-by-count-alone",
        "jetloop/consumers/runtime.py",
        "        return self.rt.stored_since_link(self.msg.metadata.timestamp.timestamp())\n",
        "        return True\n",
        "a message a restarted server delivers again counted as a first delivery is taken for "
        "one: a read a delivery before it made is made again unclaimed, one attempt for two",
        (
            "tests/test_step_reads.py::test_a_message_stored_before_the_link_is_not_a_first_delivery",
        ),
    ),
    Mutation(
        "retried-cas-conflict-taken-as-landed",
        "jetloop/streams/state.py",
        "                if again and (rev := await landed()) is not None:\n"
        "                    return rev  # our earlier try landed; its answer was lost\n",
        "                if again:\n                    return await self.revision(key) or 0\n",
        "a write retried after a lost answer that then conflicts is taken for its earlier try "
        "landed, without reading back what the key holds",
        (
            "tests/test_cluster_faults.py::"
            "test_a_worker_cut_off_at_its_mark_stands_down_and_the_write_is_made_once",
        ),
    ),
    Mutation(
        "usage-not-told-again",
        "jetloop/consumers/run_model.py",
        "        told = Followers(usage_again(rt, turn))\n",
        "        told = Followers()\n",
        "a model step found answered does not tell its usage again: a server that kept the "
        "commit and lost the usage beside it loses a paid call from the ledger",
        ("tests/test_usage.py::test_a_usage_record_a_server_lost_beside_its_commit_is_told_again",),
    ),
    Mutation(
        "kept-reads-not-joined-from",
        "jetloop/streams/state.py",
        "            c if c is not None else _kept_read(reads, k) for c, k in",
        "            c for c, k in",
        "a join from state does not see the reads its step kept together: a step whose last "
        "call ends by its own message (a wait) never moves the turn",
        (
            "tests/test_call_tools.py::test_a_steps_reads_wait_for_a_sibling_that_waits",
            "tests/test_resume.py::"
            "test_outcome_committed_before_its_worker_died_is_told_after_the_turn_moved_on",
        ),
    ),
    Mutation(
        "kept-reads-unfenced",
        "jetloop/consumers/call_tool.py",
        "        kept = await _reads_fenced(env)\n",
        "        kept = None\n",
        "a read delivered again claims without fencing its step's reads record: the earlier "
        "delivery, stalled, still keeps its reads after the takeover and acks its message",
        ("tests/test_crash.py::test_stalled_unclaimed_read_commits_nothing_after_a_takeover",),
    ),
)

# Run inside the test suite (tests/test_mutations.py): each is caught by a test that fails
# early (the others wait out a timeout), so the subset costs about a minute on two cores.
CI_SUBSET: tuple[str, ...] = (
    "tool-args-shared",
    "dispatch-acks-when-lost",
    "dispatch-settles-taken-over",
    "no-fence-check-before-the-tool",
    "no-fence-check-before-the-model-call",
    "approval-gate-passes-while-pending",
    "lost-write-recorded-succeeded",
    "single-attempt-write-marked-running",
    "idempotency-key-per-attempt",
    "no-attempt-exhaustion",
    "no-read-back-of-a-lost-reply",
    "no-outcome-event-once-the-turn-moved-on",
    "seal-not-checked",
    "seal-not-bound-to-key",
    "seal-time-not-checked",
    "seal-revision-not-checked",
    "only-checkpoints-sealed",
    "live-holder-taken-over",
    "heartbeat-rewrites-a-value-read-before-the-lock",
    "join-unelected",
    "reconcile-without-join",
    "history-not-restored",
    "read-delivered-again-unclaimed",
    "silence-counted-through-an-outage",
    "copy-believed-on-a-new-link",
)

BY_NAME = {m.name: m for m in MUTATIONS}


class MutationError(Exception):
    """A mutation that cannot be applied or run: the list is out of step with the code."""


@dataclass(frozen=True)
class Result:
    mutation: Mutation
    caught: bool
    seconds: float
    failed: tuple[str, ...]  # the tests that failed (caught it)
    output: str


def apply(m: Mutation, root: Path) -> None:
    """Apply ``m`` to the tree at ``root``, or raise ``MutationError`` naming what is wrong."""
    if not m.path.startswith(("jetloop/consumers/", "jetloop/streams/", "jetloop/sessions/")):
        raise MutationError(
            f"{m.name}: {m.path} is not under jetloop/consumers/, streams/ or sessions/"
        )
    target = root / m.path
    if not target.is_file():
        raise MutationError(f"{m.name}: {m.path} does not exist")
    text = target.read_text()
    found = text.count(m.find)
    if found != 1:
        raise MutationError(
            f"{m.name}: the snippet is found {found} times in {m.path} (it must be once)"
        )
    target.write_text(text.replace(m.find, m.replace))
    # Its copied bytecode goes too: what runs is compiled from the mutated source, whatever
    # the timestamps say.
    for cached in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
        cached.unlink()


def copy_tree(dest: Path) -> Path:
    tree = dest / "jetloop"
    shutil.copytree(ROOT, tree, ignore=_ignored, symlinks=True)
    return tree


def _ignored(directory: str, names: list[str]) -> set[str]:
    """What ``copy_tree`` leaves out. The package's bytecode caches are copied: the copy's
    interpreters then compile only what changed (the mutated module, whose cache ``apply``
    removes), not the whole package, at every mutation; Python names the copy's source in
    what it loads from them. The tests' are not (pytest's rewritten modules would name the
    original's files in their tracebacks)."""
    out = set(shutil.ignore_patterns(*IGNORED)(directory, names))
    if Path(directory).resolve().is_relative_to(ROOT / "tests"):
        out |= {n for n in names if n == "__pycache__" or n.endswith(".pyc")}
    return out


def env_for(tree: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def check_import(m: Mutation, tree: Path) -> None:
    """A subprocess started as the tests start workers imports the mutated copy."""
    probe = (
        "import importlib, sys\n"
        f"mod = importlib.import_module({m.module!r})\n"
        "print(mod.__file__)\n"
        f"src = open(mod.__file__).read()\n"
        f"sys.exit(0 if {m.replace!r} in src else 3)\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tree,
        env=env_for(tree),
        capture_output=True,
        text=True,
        timeout=60,
    )
    where = got.stdout.strip()
    if got.returncode != 0 or not Path(where).resolve().is_relative_to(tree.resolve()):
        raise MutationError(
            f"{m.name}: a subprocess imports {m.module} from {where or '?'}, not the mutated "
            f"copy ({got.stderr.strip()[-300:]})"
        )


def check(m: Mutation, each: bool = False, verbose: bool = False) -> Result:
    """Apply ``m`` to a temporary copy and run its tests there."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"jl-mut-{m.name}-") as tmp:
        tree = copy_tree(Path(tmp))
        apply(m, tree)
        check_import(m, tree)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=--strict-markers",
            "-rf",
            *([] if each else ["-x"]),
            *m.tests,
        ]
        out = subprocess.run(
            cmd,
            cwd=tree,
            env=env_for(tree),
            capture_output=True,
            text=True,
            timeout=60 * 30,
        )
    text = out.stdout + out.stderr
    if verbose:
        print(text)
    if out.returncode not in (0, 1):
        # 2: interrupted or a collection error, 4: a node id that does not exist, 5: none ran.
        raise MutationError(f"{m.name}: pytest exited {out.returncode}:\n{text[-3000:]}")
    failed = tuple(
        ln.removeprefix("FAILED ").split(" - ")[0]
        for ln in text.splitlines()
        if ln.startswith("FAILED ")
    )
    return Result(m, out.returncode == 1, time.monotonic() - started, failed, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.mutations", description=__doc__.split("\n")[0]
    )
    ap.add_argument("names", nargs="*", help="mutations to run (default: the CI subset)")
    ap.add_argument("--all", action="store_true", help="every mutation")
    ap.add_argument("--each", action="store_true", help="run every named test (no -x)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            ci = " [ci]" if m.name in CI_SUBSET else ""
            print(f"{m.name}{ci}: {m.bug}\n    {m.path}; " + "\n    ".join(m.tests))
        return 0
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        print(f"unknown mutation(s): {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    names = [m.name for m in MUTATIONS] if args.all else (args.names or list(CI_SUBSET))
    started = time.monotonic()
    survived: list[str] = []
    broken: list[str] = []
    for name in names:
        try:
            r = check(BY_NAME[name], each=args.each, verbose=args.verbose)
        except MutationError as exc:
            broken.append(name)
            print(f"ERROR     {name}: {exc}", flush=True)
            continue
        verdict = "caught  " if r.caught else "SURVIVED"
        by = f" by {', '.join(r.failed)}" if r.failed else ""
        print(f"{verdict}  {name} ({r.seconds:.0f}s){by}", flush=True)
        if not r.caught:
            survived.append(name)
    total = time.monotonic() - started
    print(
        f"{len(names) - len(survived) - len(broken)} caught, {len(survived)} survived, "
        f"{len(broken)} could not run, in {total:.0f}s"
    )
    return 1 if survived or broken else 0


if __name__ == "__main__":
    sys.exit(main())
