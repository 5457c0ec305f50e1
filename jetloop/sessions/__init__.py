"""The read and decision side of sessions: what the client, the control service, the gateway
and the CLI ask of a session, between the engine (``jetloop.consumers``, whose step handlers
import nothing from here) and the processes (``jetloop.services``).

- ``snapshot``: everything about a session in one read (``SessionSnapshot``);
- ``turns``: a session's turns, a page at a time, and one turn in detail;
- ``decisions``: approve, reject, answer, cancel, reconcile, approval policy — each a CAS on
  its record and a publish of the step that moves the turn on (``Control``; a refusal is a
  ``ControlError``).
"""
