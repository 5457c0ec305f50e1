"""Records a step message carries for its step, sealed so that only a worker could have made
them.

A step publishing a model step knows the turn and session records that step would read
first: it just wrote or read them. The ``run_model`` message carries them
(``schemas.Carried``), with their revisions, so a first delivery starts without reading them
back. They are a hint: the model step's first write is a CAS from the carried turn revision
(a turn written since fails it, and the step reads).

A step message may be published by anyone allowed ``jl.step.>``, which the seal key does not
protect. So the carried records are sealed as a record in ``jl_state`` is, under the key
``carried.<session>.<turn>``, bound to the turn revision they describe and to the time they
were sealed (within the seal's tolerance of the time the server stored the message). A
message whose carried records do not verify is read as if it carried none: forging one can
make a step read, never make it act on records no worker wrote (a forged turn at the turn's
current revision would pass the CAS, and be written back sealed, as the worker's own). A
carry sealed for an earlier revision of the turn is one the CAS rejects.
"""

from __future__ import annotations

import structlog

from jetloop.consumers.runtime import Delivery
from jetloop.schemas import Carried, SessionRecord, TurnRecord
from jetloop.schemas.errors import SealError
from jetloop.streams.seal import Sealer

log = structlog.get_logger("jetloop.carry")


def _key(turn: TurnRecord) -> str:
    return f"carried.{turn.session_id}.{turn.turn_id}"


def _data(c: Carried) -> dict[str, object]:
    data: dict[str, object] = c.model_dump(mode="json", exclude_none=True)
    return data


def carry(
    sealer: Sealer | None,
    turn: TurnRecord,
    turn_revision: int,
    session: SessionRecord,
    session_revision: int,
) -> Carried | None:
    """The records for the next step's message, sealed (None: this process cannot seal now,
    its clock is off; the next step reads)."""
    c = Carried(
        turn=turn, turn_revision=turn_revision, session=session, session_revision=session_revision
    )
    if sealer is None:
        return c  # records are not sealed either: a carry is as good as a read
    try:
        return c.model_copy(update={"seal": sealer.seal(_key(turn), _data(c), turn_revision)})
    except SealError:
        return None


def trusted_carry(d: Delivery, c: Carried | None) -> Carried | None:
    """What the message carries, if a worker sealed it for this turn and this revision, and
    this is the message's first delivery (a redelivery's carry is likely stale)."""
    if c is None or not d.first_sight:
        return None
    sealer = d.rt.state.sealer
    if sealer is None:
        return c
    stored_at = d.msg.metadata.timestamp.timestamp()
    why = sealer.verify(_key(c.turn), _data(c), stored_at, c.turn_revision)
    if why is not None:
        log.warning("step.carry_refused", reason=why)
        return None
    return c
