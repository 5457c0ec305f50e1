"""What a provider adapter raises, and what each error tells the engine to do.

    ModelError                      (jetloop.agents.model: the model step failed this attempt)
     └── ProviderError              provider, status, message, error_type, request_id
          ├── ProviderRetryable     retry_after: try again later (429, 408, 409, 5xx,
          │                         timeouts, lost connections, a cut or failed stream)
          └── ProviderRejected      the provider refused the request as it stands (other
                                    4xx): another attempt with the same input cannot help

Every error carries what the provider said, never the API key: adapters scrub it from the
provider's message before the error is built, so ``str``, ``repr`` and logs are safe.
"""

from __future__ import annotations

from jetloop.agents.model import ModelError


class ProviderError(ModelError):
    """A model provider's HTTP API failed or refused a request."""

    def __init__(
        self,
        provider: str,
        message: str,
        *,
        status: int | None = None,
        error_type: str | None = None,
        request_id: str | None = None,
    ) -> None:
        where = f"{provider} HTTP {status}" if status is not None else provider
        super().__init__(f"{where}: {message}")
        self.provider = provider
        self.message = message
        self.status = status
        # The provider's own classification ("rate_limit_error", "context_length_exceeded", …):
        # lets the engine tell a too-long prompt (compact, then retry) from a bad request.
        self.error_type = error_type
        self.request_id = request_id

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(provider={self.provider!r}, status={self.status!r}, "
            f"error_type={self.error_type!r}, message={self.message!r})"
        )


class ProviderRetryable(ProviderError):
    """The call may succeed later: retry after ``retry_after`` seconds if the provider said."""

    def __init__(
        self,
        provider: str,
        message: str,
        *,
        retry_after: float | None = None,
        status: int | None = None,
        error_type: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(
            provider, message, status=status, error_type=error_type, request_id=request_id
        )
        self.retry_after = retry_after


class ProviderRejected(ProviderError):
    """The provider refused this request (bad input, auth, quota): fail the step at once."""
