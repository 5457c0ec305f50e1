"""Restate for ``jetloop bench peer``: the turn service (``service``), and the server, the
service process and the driver (``side``).

The server comes from the npm package ``@restatedev/restate-server`` (``package.json`` and
``package-lock.json`` here; ``npm ci --prefix jetloop/tooling/bench/restate`` puts its native
binary under ``node_modules``, which is not committed); the service needs ``restate-sdk`` and
``hypercorn`` (the ``peer`` extra). Nothing here is imported unless the peer benchmark runs.
"""
