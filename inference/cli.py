"""`kvd-engine`: runs the inference engine against a KV-cache daemon.

Its settings are declared once, on the fields of ``EngineSettings``
(``inference/config.py``), where their values live: each flag with the
environment variable that sets it (for containers), read here, once, and
nowhere deeper.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from inference import heap, openmp
from inference.config import EngineSettings
from kvd.common import logs
from kvd.common.config_fields import config_from, settings_of
from kvd.common.settings import SettingsCommand, log_level, parse, refuse_retired_variables

log = logging.getLogger("inference")

COMMAND = SettingsCommand(
    "kvd-engine",
    help="The inference engine: a Hugging Face model on the KV-cache daemon's paged memory.",
    params=[*settings_of(EngineSettings), log_level()],
)


def main(argv: list[str] | None = None) -> int:
    refuse_retired_variables("kvd-engine")
    args = parse(COMMAND, argv)
    logs.configure(args.log_level)
    openmp.set_defaults()  # NOTE: before torch loads OpenMP
    heap.keep_freed_memory()
    from inference.app import EngineApp

    try:
        settings = config_from(EngineSettings, args)
        app = EngineApp(settings)
    except ValueError as exc:
        print(f"kvd-engine: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    app.start()
    while not stop.wait(0.2):
        if app.engine.fatal:
            print(f"kvd-engine: {app.engine.fatal}", file=sys.stderr)
            app.stop()
            return 2
        if app.drained:  # a Drain call: it has answered, the engine is detached
            break
    # NOTE: SIGTERM (a rolling replacement, docker stop, Kubernetes) drains:
    # no request is lost and the daemon keeps every block this engine computed.
    log.info("engine stopping")
    app.drain()
    app.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
