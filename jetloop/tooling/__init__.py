"""Tooling around the product, not part of what runs a turn: benchmarks and kill trials.

- ``bench/``   ``jetloop bench``: the engine against the raw JetStream floor and a peer
- ``trials/``  ``jetloop trials`` and the fault harness the test suite uses too: worker
               processes, a local 3-node cluster, servers to kill and restart
- ``powercut/`` a filesystem that loses what was not synced: power cuts under a store

May import anything of the product; nothing in the product imports it
(``tests/test_layers.py``).
"""
