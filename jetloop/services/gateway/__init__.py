"""The HTTP gateway (aiohttp): REST, server-sent events, inbound webhooks, OpenAPI.

- ``app``      the handlers, the routes and the ``Gateway`` service (``jetloop gateway``)
- ``http``     problem+json errors, authentication by bearer token and scope, request parsing
- ``config``   ``GatewayConfig`` (tokens and their namespaces, hooks, limits) from the settings
- ``state``    what the handlers share: one NATS client and read model per namespace
- ``hooks``    Standard Webhooks and GitHub signatures, replay windows, session templates
- ``sse``      following a session's events as ``text/event-stream``, resumable by id
- ``openapi``  the OpenAPI document, built from the same pydantic models as the handlers

May import ``jetloop.services.client``, ``jetloop.services.readmodel`` and everything below
``services``.
"""
