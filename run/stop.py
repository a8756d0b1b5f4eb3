"""Graceful stop on SIGTERM, SIGINT and SIGUSR1 (what schedulers send before they end a job).

Before training starts (`arm()`), there is nothing to save: a signal exits at once with a one-line
message, releasing what `release_on_early_exit` was given (the run's lock). Once armed, the handler only
records the signal; the training loop asks `requested()` after every optimiser step, and every rank agrees
on the answer (a one-element all-reduce), so all ranks stop after the same step, save it and exit 0. A
second SIGINT (Ctrl-C twice) exits at once.
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
        self._releases: list = []

    def release_on_early_exit(self, release) -> None:
        """Call `release` if a signal ends the run before training starts."""
        self._releases.append(release)

    def arm(self) -> None:
        """From now on a signal stops the run after the current step, with a checkpoint."""
        self.armed = True

    def _handle(self, signum, frame) -> None:
        if not self.armed:
            # The handler exits itself rather than raise SystemExit: it can run inside a call that native
            # code makes back into Python (rustbpe's log lines while it trains the tokenizer), which would
            # print the exception as a traceback and carry on.
            name = signal.Signals(signum).name
            print(f"{name} received before training started: exiting", file=sys.stderr, flush=True)
            for release in self._releases:
                release()
            sys.stdout.flush()
            os._exit(1)
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
