"""Fake model providers for tests: each speaks one provider's HTTP wire format exactly."""

from tests.fakes.anthropic import FakeAnthropic
from tests.fakes.base import Failure, FakeCall, FakeProvider, Raw, Received, Reply, Stall
from tests.fakes.openai_chat import FakeOpenAIChat
from tests.fakes.openai_responses import FakeOpenAIResponses

__all__ = [
    "Failure",
    "FakeAnthropic",
    "FakeCall",
    "FakeOpenAIChat",
    "FakeOpenAIResponses",
    "FakeProvider",
    "Raw",
    "Received",
    "Reply",
    "Stall",
]
