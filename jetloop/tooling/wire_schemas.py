"""JSON Schema files of the wire (docs/schemas/), generated from the pydantic models.

Every message, record, event (and each event type's ``data``) and control request and reply
a client in another language meets is written as one file, so that language can generate
its types. A ``jl_state`` record's file describes it as stored: with the ``seal`` the store
adds to every record it writes (``jetloop.streams.state``), which the models do not all
carry. The files are checked in; ``tests/test_wire_schemas.py`` fails when one is stale.

    python -m jetloop.tooling.wire_schemas            # write docs/schemas/
    python -m jetloop.tooling.wire_schemas --check    # exit 1 and name the stale files
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from pydantic import BaseModel

from jetloop.schemas import (
    EVENT_DATA,
    SCHEMA_VERSION,
    ApprovalRecord,
    CallRecord,
    CompactionRecord,
    Event,
    HistoryEntry,
    ParentCall,
    QuestionRecord,
    SessionRecord,
    StepMessage,
    StepReads,
    TurnRecord,
    TurnRequest,
)
from jetloop.services.control import REQUESTS, Reply
from jetloop.sessions.snapshot import SessionSnapshot
from jetloop.streams.seal import OLD_VERSION, SEAL_FIELD, SEAL_VERSION

OUT = Path(__file__).resolve().parents[2] / "docs" / "schemas"


def _kebab(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()


# The records of the jl_state bucket (docs/protocol.md, "State"), each stored with a seal.
RECORDS: dict[str, type[BaseModel]] = {
    "session-record": SessionRecord,
    "turn-record": TurnRecord,
    "call-record": CallRecord,
    "step-reads": StepReads,
    "approval-record": ApprovalRecord,
    "question-record": QuestionRecord,
    "compaction-record": CompactionRecord,
}

# The seal as jetloop.streams.seal writes it (v3), or as the jetloop before wrote it (v2,
# still read): docs/security.md, "The exact bytes".
SEAL = {
    "type": "string",
    "title": "Seal",
    "pattern": rf"^({SEAL_VERSION}\.[0-9]+\.[0-9]+|{OLD_VERSION}\.[0-9]+)\.[0-9a-f]{{64}}$",
    "description": (
        f"{SEAL_VERSION}.<ms>.<rev>.<64 hex>: an HMAC-SHA256 over the record (this map "
        "without its seal, the last entry), its key, the seal time in Unix milliseconds and "
        f"the revision it was written over (see docs/security.md); {OLD_VERSION}.<ms>.<64 "
        "hex> from an older jetloop still verifies"
    ),
}


def models() -> dict[str, type[BaseModel]]:
    """File stem -> model, in the order docs/protocol.md tells them."""
    out: dict[str, type[BaseModel]] = {
        "turn-request": TurnRequest,
        "parent-call": ParentCall,
        "event": Event,
        "history-entry": HistoryEntry,
        "step-message": StepMessage,
        **RECORDS,
    }
    for etype, data in EVENT_DATA.items():
        out[f"event-data.{etype.value}"] = data
    for op, req in REQUESTS.items():
        out[f"control.{op}.request"] = req
    out["control.reply"] = Reply
    out["control.snapshot.result"] = SessionSnapshot
    return out


def render() -> dict[str, str]:
    """File name -> its text (2-space JSON, sorted keys, one newline at the end)."""
    files = {}
    for stem, model in models().items():
        schema = model.model_json_schema(mode="validation")
        if stem in RECORDS:
            schema["properties"][SEAL_FIELD] = SEAL
            required = [r for r in schema.get("required", []) if r != SEAL_FIELD]
            schema["required"] = [*required, SEAL_FIELD]
        schema["$id"] = f"urn:jetloop:schema:v{SCHEMA_VERSION}:{stem}"
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$comment"] = (
            f"Generated from {model.__module__}.{model.__name__} by "
            "`python -m jetloop.tooling.wire_schemas`; do not edit. See docs/protocol.md."
        )
        files[f"{stem}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def stale(out: Path = OUT) -> list[str]:
    """Names of the files that differ from what the models make (missing, changed, extra)."""
    want = render()
    have = {p.name for p in out.glob("*.json")} if out.exists() else set()
    changed = [n for n, text in want.items() if n not in have or (out / n).read_text() != text]
    return sorted(changed + sorted(have - set(want)))


def write(out: Path = OUT) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    want = render()
    for p in out.glob("*.json"):
        if p.name not in want:
            p.unlink()
    for name, text in want.items():
        (out / name).write_text(text)
    return sorted(want)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a file is stale")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        for name in bad:
            print(f"stale: {args.out / name}", file=sys.stderr)
        if bad:
            print("run: python -m jetloop.tooling.wire_schemas", file=sys.stderr)
        return 1 if bad else 0
    print(f"wrote {len(write(args.out))} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
