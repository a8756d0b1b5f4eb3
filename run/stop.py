"""Graceful stop on SIGTERM, SIGINT and SIGUSR1 (what schedulers send before they end a job).

Before training starts (`arm()`), there is nothing to save: a signal exits at once with a one-line
message. Once armed, the handler only records the signal; the training loop asks `requested()` after
every optimiser step, and every rank agrees on the answer (a one-element all-reduce), so all ranks stop
after the same step, save it and exit 0. A second SIGINT (Ctrl-C twice) exits at once.
"""

import os
import signal
import sys

from run.dist import DistInfo, any_rank

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class GracefulStop:
    def __init__(self, info: DistInfo):
        self.info = info
        self.received: int | None = None
        self.armed = False
        self._previous: dict = {}

    def arm(self) -> None:
        """From now on a signal stops the run after the current step, with a checkpoint."""
        self.armed = True

    def _handle(self, signum, frame) -> None:
        if not self.armed:
            raise SystemExit(f"{signal.Signals(signum).name} received before training started: exiting")
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            print("\nsecond SIGINT: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        if self.received is None:
            self.received = signum
            if self.info.is_main:
                print(
                    f"\n{signal.Signals(signum).name} received: finishing this step, then saving a "
                    "checkpoint and exiting (Ctrl-C again to exit now)",
                    file=sys.stderr,
                    flush=True,
                )

    def __enter__(self) -> "GracefulStop":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self) -> bool:
        """Whether any rank received a stop signal; a collective, so every rank must call it each step."""
        return any_rank(self.received is not None, self.info)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
