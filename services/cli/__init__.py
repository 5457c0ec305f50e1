"""The ``jetloop`` command (click): one entry point, ``main``.

- ``main``       the command group and every command
- ``inspector``  what ``jetloop inspect`` reads and prints (streams, consumers, keys, dead letters)
"""

from services.cli.main import main

__all__ = ["main"]
