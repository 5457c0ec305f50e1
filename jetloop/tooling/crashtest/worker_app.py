"""The app a crash test's workers serve: the user's, with its tools watched.

``jetloop worker --app jetloop.tooling.crashtest.worker_app:watched`` with
``JETLOOP_CRASHTEST_APP`` (the user's ``module:attr``), ``JETLOOP_CRASHTEST_LEDGER`` (the
ledger file) and, optionally, ``JETLOOP_CRASHTEST_SCRIPT`` (a model script that replaces
every agent's model). Set by ``jetloop.tooling.crashtest.run``; not meant to be run by hand.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jetloop.agents.agent import App, load_app
from jetloop.consumers.faults import Faults
from jetloop.tooling.crashtest.ledger import Ledger, watch
from jetloop.tooling.crashtest.script import read_script, scripted_model

SPEC = "jetloop.tooling.crashtest.worker_app:watched"


def watched() -> App:
    app = load_app(os.environ["JETLOOP_CRASHTEST_APP"])
    script = os.environ.get("JETLOOP_CRASHTEST_SCRIPT")
    if script:
        model = scripted_model(read_script(Path(script)))
        app = App(dataclasses.replace(a, model=model) for a in app.agents.values())
    return watch(app, Ledger(Path(os.environ["JETLOOP_CRASHTEST_LEDGER"])), Faults.from_env())
