"""The public face and the settings: names users rely on, errors that name the setting."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import nats.errors
import pytest

import jetloop
from jetloop.schemas.errors import SettingsError
from jetloop.services.settings import load_settings


def test_public_names_are_pinned() -> None:
    """What `import jetloop` offers changes only on purpose."""
    assert sorted(jetloop.__all__) == sorted(
        [
            "TOOL_CALL_NOT_RUN_ERROR_PREFIX",
            "Agent",
            "App",
            "Budget",
            "Client",
            "Effect",
            "EmbeddedServer",
            "Limits",
            "MCPServer",
            "Message",
            "ModelAdapter",
            "ModelError",
            "ModelRequest",
            "ModelResponse",
            "RetryableToolError",
            "ScriptedModel",
            "Settings",
            "SettingsError",
            "InvalidName",
            "Tool",
            "ToolCallRequest",
            "ToolContext",
            "ToolError",
            "ToolSpec",
            "TurnFailed",
            "TurnHandle",
            "TurnResult",
            "Worker",
            "load_app",
            "load_settings",
            "tool",
            "Found",
            "MalformedToolCall",
            "NotFound",
            "ProviderError",
            "ProviderRejected",
            "ProviderRetryable",
            "TaskDone",
            "TaskFailed",
            "TaskPending",
            "Trigger",
            "adapter_from_spec",
            "ask_user",
            "delegate",
            "served_elsewhere",
            "task_tool",
            "wait",
            # reading what happened
            "CallView",
            "Event",
            "EventType",
            "SessionSnapshot",
            "TurnDetail",
            "TurnPage",
            "TurnRecord",
            "TurnStatus",
            "TurnSummary",
            # the error tree
            "AppLoadError",
            "ControlError",
            "DecodeError",
            "JetloopError",
            "NamespaceError",
            "UpError",
            "NotAuthorized",
            "WrongNamespace",
            "RecordNotTrusted",
            "SealError",
            "SealKeyMissing",
            "UnknownAgent",
            "UnknownId",
            "UnknownSession",
            "UnknownTurn",
        ]
    )
    # What the module really offers is what `__all__` says: no pinned name missing, no other
    # public name (a helper imported into jetloop/__init__.py would be one users start to rely on).
    # (The internal packages are attributes of the package once imported: not names it offers.)
    offered = {
        n
        for n in dir(jetloop)
        if not n.startswith("_") and not isinstance(getattr(jetloop, n), types.ModuleType)
    }
    assert offered == set(jetloop.__all__)
    assert jetloop.TOOL_CALL_NOT_RUN_ERROR_PREFIX == (
        "the tool did not run, so it is safe to call again"
    )


def test_errors_form_one_documented_tree() -> None:
    """Every error jetloop raises on purpose is a JetloopError, placed as the tree drawn in
    jetloop's docstring says; the engine's own names for them are the same classes."""
    from jetloop.streams.seal import SealBroken

    tree = {
        jetloop.SealError: jetloop.JetloopError,
        jetloop.SealKeyMissing: jetloop.SealError,
        jetloop.RecordNotTrusted: jetloop.SealError,
        jetloop.UnknownId: jetloop.JetloopError,
        jetloop.UnknownAgent: jetloop.UnknownId,
        jetloop.UnknownSession: jetloop.UnknownId,
        jetloop.UnknownTurn: jetloop.UnknownId,
        jetloop.ControlError: jetloop.JetloopError,
        jetloop.TurnFailed: jetloop.JetloopError,
        jetloop.SettingsError: jetloop.JetloopError,
        jetloop.NamespaceError: jetloop.JetloopError,
        jetloop.AppLoadError: jetloop.JetloopError,
        jetloop.UpError: jetloop.JetloopError,
        jetloop.DecodeError: jetloop.JetloopError,
        jetloop.InvalidName: jetloop.JetloopError,
        jetloop.NotAuthorized: jetloop.JetloopError,
        jetloop.WrongNamespace: jetloop.JetloopError,
        jetloop.ModelError: jetloop.JetloopError,
        jetloop.ProviderError: jetloop.ModelError,
        jetloop.ProviderRetryable: jetloop.ProviderError,
        jetloop.ProviderRejected: jetloop.ProviderError,
        jetloop.ToolError: jetloop.JetloopError,
        jetloop.RetryableToolError: jetloop.JetloopError,
    }
    for error, parent in tree.items():
        assert issubclass(error, parent), (error, parent)
        assert error.__name__ in (jetloop.__doc__ or ""), error
    assert issubclass(jetloop.UnknownId, LookupError)
    assert issubclass(jetloop.NotAuthorized, nats.errors.Error)
    assert issubclass(jetloop.SettingsError, ValueError)
    assert issubclass(jetloop.InvalidName, ValueError)
    for valueish in (jetloop.NamespaceError, jetloop.AppLoadError, jetloop.DecodeError):
        assert issubclass(valueish, ValueError), valueish
    assert issubclass(SealBroken, jetloop.RecordNotTrusted)
    assert "JETLOOP_SEAL_KEY" in str(jetloop.SealKeyMissing("the turn"))


def test_every_public_error_is_defined_in_one_module() -> None:
    """Every exception `jetloop` offers is a JetloopError defined in jetloop.schemas.errors,
    that module defines only those, and no other module derives a class from one of them
    except the two names the module's docstring gives."""
    from jetloop.schemas import errors

    public = {
        name
        for name in jetloop.__all__
        if isinstance(getattr(jetloop, name), type)
        and issubclass(getattr(jetloop, name), BaseException)
    }
    elsewhere = {n: getattr(jetloop, n).__module__ for n in public}
    assert {n: m for n, m in elsewhere.items() if m != errors.__name__} == {}
    assert [n for n in public if not issubclass(getattr(jetloop, n), jetloop.JetloopError)] == []
    defined = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
    }
    assert defined == public
    for name in public:
        assert name in (errors.__doc__ or ""), name

    # Read from the source, so that a module no test imports cannot hide a second tree.
    root = Path(jetloop.__file__).parent
    derived = set()
    for path in sorted(root.rglob("*.py")):
        if path == Path(errors.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", None) or getattr(b, "attr", "") for b in node.bases}
                if bases & public:
                    derived.add(f"{path.relative_to(root).as_posix()}:{node.name}")
    assert derived == {
        "streams/seal.py:SealBroken",
        "streams/clock.py:ClockOff",
        "schemas/codec.py:NewerWriter",
    }


def test_every_public_name_is_documented() -> None:
    """Each name of `jetloop` has a docstring of its own, and docs/api.md lists it."""
    from pathlib import Path

    api = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    undocumented, unlisted = [], []
    for name in jetloop.__all__:
        obj = getattr(jetloop, name)
        if f"`{name}`" not in api:
            unlisted.append(name)
        if not (isinstance(obj, type) or callable(obj)) or isinstance(obj, jetloop.Tool):
            continue  # a constant, or a built-in tool (its Tool is documented)
        doc = getattr(obj, "__doc__", None) or ""
        if doc.startswith(f"{name}("):  # the signature a dataclass writes for itself
            doc = ""
        inherited = isinstance(obj, type) and any(
            doc == (getattr(b, "__doc__", None) or "") for b in obj.__mro__[1:]
        )
        if not doc.strip() or inherited:
            undocumented.append(name)
    assert undocumented == [] and unlisted == [], (undocumented, unlisted)


def test_wrong_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong value fails at start, and the error names the environment variable."""
    monkeypatch.setenv("JETLOOP_LEASE_SECONDS", "soon")
    with pytest.raises(SettingsError, match="JETLOOP_LEASE_SECONDS"):
        load_settings()
    monkeypatch.setenv("JETLOOP_LEASE_SECONDS", "5")
    monkeypatch.setenv("JETLOOP_NATS_URL", "http://example")
    with pytest.raises(SettingsError, match="JETLOOP_NATS_URL"):
        load_settings()


def test_cli_reports_wrong_setting() -> None:
    """The CLI exits non-zero with the setting's name instead of a traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "jetloop.services.cli", "worker"],
        env={"JETLOOP_TOOL_CONCURRENCY": "0", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "JETLOOP_TOOL_CONCURRENCY" in out.stderr
    assert "Traceback" not in out.stderr


def test_tool_and_agent_definitions_are_checked() -> None:
    """Mistakes in agent definitions fail when the app is built, with a clear message."""
    from pydantic import BaseModel

    class A(BaseModel):
        x: int

    async def fn(args: A, ctx: jetloop.ToolContext) -> int:
        return args.x

    t = jetloop.tool(effect=jetloop.Effect.READ, args_model=A)(fn)
    model = jetloop.ScriptedModel(lambda req: jetloop.ModelResponse(text="hi"))
    with pytest.raises(ValueError, match="two tools are named 'fn'"):
        jetloop.Agent(name="a", instructions="", model=model, tools=(t, t))
    with pytest.raises(ValueError, match="agent name 'bad name'"):
        jetloop.Agent(name="bad name", instructions="", model=model)
    with pytest.raises(ValueError, match="expected module:attr"):
        jetloop.load_app("nocolon")
