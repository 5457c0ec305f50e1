"""``adapter_from_spec``: one string names a provider and a model (for settings and the CLI).

    openai:<model>                          OpenAI Chat Completions
    openai-responses:<model>                OpenAI Responses
    anthropic:<model>                       Anthropic Messages
    openai-compatible:<model>@<base_url>    any Chat Completions server (vLLM, Ollama, …)

The key is given, never looked up here: settings read it (as a secret) and pass it in.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import SecretStr

from jetloop.agents.adapters.anthropic import AnthropicAdapter
from jetloop.agents.adapters.base import HttpAdapter
from jetloop.agents.adapters.openai_chat import OpenAIChatAdapter
from jetloop.agents.adapters.openai_responses import OpenAIResponsesAdapter

PROVIDERS: dict[str, type[HttpAdapter]] = {
    "openai": OpenAIChatAdapter,
    "openai-responses": OpenAIResponsesAdapter,
    "anthropic": AnthropicAdapter,
    "openai-compatible": OpenAIChatAdapter,
}
# The model is everything before the last "@" that starts a URL: model names may hold "@".
_COMPATIBLE = re.compile(r"^(?P<model>.+)@(?P<url>https?://\S+)$")


def adapter_from_spec(
    spec: str,
    *,
    api_key: str | SecretStr | None = None,
    base_url: str | None = None,
    **options: Any,
) -> HttpAdapter:
    """The adapter ``spec`` names; ``options`` go to its constructor (timeout, max_tokens, …)."""
    provider, sep, model = spec.partition(":")
    if not sep or provider not in PROVIDERS or not model:
        names = ", ".join(f"{p}:<model>" for p in PROVIDERS)
        raise ValueError(f"model spec {spec!r}: expected one of {names}")
    if provider == "openai-compatible":
        match = _COMPATIBLE.match(model)
        if match:
            model, base_url = match["model"], base_url or match["url"]
        if not base_url:
            raise ValueError(
                f"model spec {spec!r}: openai-compatible needs a base URL "
                "(openai-compatible:<model>@<base_url>, or base_url=…)"
            )
    elif api_key is None or (isinstance(api_key, str) and not api_key.strip()):
        raise ValueError(f"model spec {spec!r}: {provider} needs an API key")
    return PROVIDERS[provider](model, api_key=api_key, base_url=base_url, **options)
