"""Crash-test a user's own agent: its app and tools, killed at every step boundary.

- ``run``        the test: discover the boundaries, kill at each and at random, judge
- ``judge``      the verdict and the report, from the tool ledger and the events
- ``ledger``     every invocation of every tool, in a file outside the store
- ``script``     the messages a test sends, and the scripted model it may use
- ``worker_app`` the app its workers serve: the user's, tools watched

From the command line: ``jetloop trials --app module:attr --messages FILE``; from Python:
``jetloop.testing.crash_test``.
"""
