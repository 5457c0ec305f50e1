"""The read model: sessions, turns and calls in SQLite, for lists and search.

- ``model``      the tables, and applying a batch of events to them exactly once
- ``projector``  the process (``jetloop projector``) that follows ``JL_EVENTS`` into ``model``

State (``jl_state``) stays the truth; this is a view that can be rebuilt from the stream.
"""
