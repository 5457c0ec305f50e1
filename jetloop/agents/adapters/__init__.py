"""Model adapters for real providers over HTTP: OpenAI (Chat, Responses) and Anthropic.

Each implements ``agents.ModelAdapter`` plus ``estimate_tokens`` and streaming
(``complete(request, on_delta=…)``); ``adapter_from_spec("anthropic:<model>", api_key=…)``
picks one from a string. What they raise (``ProviderError`` and its two kinds) is drawn in
``jetloop.schemas.errors``, with every other error.
"""

from jetloop.agents.adapters.anthropic import AnthropicAdapter
from jetloop.agents.adapters.base import DeltaHandler, HttpAdapter, MalformedToolCall
from jetloop.agents.adapters.factory import adapter_from_spec
from jetloop.agents.adapters.openai_chat import OpenAIChatAdapter
from jetloop.agents.adapters.openai_responses import OpenAIResponsesAdapter

__all__ = [
    "AnthropicAdapter",
    "DeltaHandler",
    "HttpAdapter",
    "MalformedToolCall",
    "OpenAIChatAdapter",
    "OpenAIResponsesAdapter",
    "adapter_from_spec",
]
