"""The ``jetloop`` command (click): one entry point, ``main``.

- ``main``             the command group and what the commands share
- ``run``              ``up``, ``worker``, ``topology``, ``trials``, ``bench``,
                       ``gateway``, ``projector``
- ``sessions``         ``send``, ``chat``, ``events``, ``snapshot``, ``sessions``
- ``decide``           ``approve``, ``answer``, ``cancel``, ``reconcile``
- ``inspect_command``  ``inspect``; what it reads and prints is ``inspector``
"""

from jetloop.services.cli.main import main  # its commands are imported when asked for

__all__ = ["main"]
