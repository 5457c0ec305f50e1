"""The agent of the README's TypeScript example ("Tools in TypeScript"): ``notes`` saves what
you tell it with ``save_note``, a tool it offers but does not make: the Node.js worker makes
it (workers/node/examples/notes.ts, pool ``ts``), writing one file per note.

    .venv/bin/jetloop worker --app examples.ts_notes:app
"""

from __future__ import annotations

from pydantic import BaseModel

import jetloop as jl


class Note(BaseModel):
    text: str


save_note = jl.served_elsewhere(
    name="save_note",
    pool="ts",
    effect=jl.Effect.IDEMPOTENT_WRITE,
    description="Save a note.",
    args_model=Note,
)


def model(req: jl.ModelRequest) -> jl.ModelResponse:
    """A scripted model: `note <text>` saves the text, then says where it went."""
    last = req.messages[-1]
    if last.role == "user":
        text = (last.text or "").removeprefix("note").strip()
        if not text:
            return jl.ModelResponse(text="say `note <text>`")
        return jl.ModelResponse(tool_calls=[jl.ToolCallRequest("save_note", {"text": text})])
    return jl.ModelResponse(text=f"saved: {last.result}")


agent = jl.Agent(
    name="notes",
    instructions="Save the user's notes.",
    model=jl.ScriptedModel(model),
    tools=(save_note,),
)
app = jl.App([agent])
