"""``jetloop bench``: what the engine costs, as ratios against baselines measured in the same run.

- ``run``      the benchmarks, the report and the targets (``main`` is the command)
- ``rig``      one server, engine workers and floor workers, and what they sent and received
- ``floor``    the raw JetStream floor: the same turn shape with KV CAS, publish, fetch, ack
- ``app``      the agents the engine runs in a benchmark (zero-latency model and tools)
- ``peer``     the same turn on DBOS Transact (the ``peer`` extra)
- ``profile``  a sampling profile of a worker under load
"""
