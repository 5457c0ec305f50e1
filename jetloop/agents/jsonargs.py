"""Tool arguments described by a JSON Schema rather than a pydantic model: the tools of an MCP
server, and a framework's tools that bring their schema with them.

The arguments are kept as the model sent them and checked against the schema as the tool's
own server would check them, so a call that fails the check is recorded failed and never made.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, create_model, model_validator


class JsonArgs(BaseModel):
    """Arguments as the model sent them, checked against ``input_schema`` (when there is one)."""

    model_config = ConfigDict(extra="allow")
    input_schema: ClassVar[dict[str, Any] | None] = None

    @model_validator(mode="before")
    @classmethod
    def _check(cls, value: Any) -> Any:
        if cls.input_schema is not None and isinstance(value, dict):
            # jsonschema comes with the MCP SDK and the agent SDKs that validate tool input.
            validator: Any = importlib.import_module("jsonschema")
            try:
                validator.validate(instance=value, schema=cls.input_schema)
            except validator.ValidationError as exc:
                raise ValueError(f"Input validation error: {exc.message}") from None
        return value


def json_args_model(name: str, schema: dict[str, Any] | None) -> type[JsonArgs]:
    """An argument model for the tool ``name`` that checks against ``schema``."""
    model = create_model(f"{name}_args", __base__=JsonArgs)
    model.input_schema = schema
    return model
