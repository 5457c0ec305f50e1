"""Model adapters for real providers over HTTP: OpenAI (Chat, Responses) and Anthropic.

Each implements ``agents.ModelAdapter`` plus ``estimate_tokens`` and streaming
(``complete(request, on_delta=…)``); ``adapter_from_spec("anthropic:<model>", api_key=…)``
picks one from a string. Errors are drawn in ``jetloop.agents.adapters.errors``.
"""

from jetloop.agents.adapters.anthropic import AnthropicAdapter
from jetloop.agents.adapters.base import DeltaHandler, HttpAdapter, MalformedToolCall
from jetloop.agents.adapters.errors import ProviderError, ProviderRejected, ProviderRetryable
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
    "ProviderError",
    "ProviderRejected",
    "ProviderRetryable",
    "adapter_from_spec",
]
