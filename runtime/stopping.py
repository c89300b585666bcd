"""Stopping on request: SIGTERM or SIGINT (a preemption, an eviction, Ctrl-C) ends training at a step
boundary with a checkpoint, never in the middle of a step and never without one.

A request reaches a worker one of two ways:
- `elastor train` under torchrun alone (or any launcher that signals its workers): its own SIGTERM
  and SIGINT handlers record the first signal; another one, DUPLICATE_S or more later, ends the
  process at once. Sooner it is the same request by another path: Ctrl-C reaches torchrun and its
  workers together and torchrun then forwards its own, and a scheduler may signal every process.
- under `elastor run`: the supervisor that was signalled writes STOP_FILE (the signal's number) into
  the round's progress directory, which a thread of each worker polls every POLL_S. There a worker
  keeps SIGTERM's default action, death: torchrun SIGTERMs the survivors of a worker that failed,
  and they must go at once rather than wait for a step that cannot finish.

Agreement costs no message: every rank adds its flag to the step's one all-reduce over the job
(`runtime/trainer.py`, beside the squared gradient norm and the loss), so every rank learns of a
request in the same step and stops after it. A request made during step k is in step k's reduction
or step k + 1's; the training loop then ends, the checkpoint of that step is written and waited for,
and the process exits (128 + the signal alone; 0 under a supervisor, which reports the stop). The
bound is therefore two steps and one synchronous save (plus POLL_S under a supervisor).

Why not torch's own: torchrun's agent only forwards signals, and `torch.distributed.elastic` has no
notion of "stop after this step"; `torch.distributed.checkpoint` saves, but somebody has to decide
when, on every rank at the same step.
"""

import os
import signal
import threading
import time
from pathlib import Path

STOP_FILE = "stop"  # in the round's progress directory: the signal's number, written by the supervisor
POLL_S = 0.2  # how often a worker under a supervisor looks for it
DUPLICATE_S = 2.0  # a signal this soon after the first repeats its request


class StopRequest:
    """The signal that asked this process to stop (None: no request)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._at = 0.0  # when the request came (monotonic)
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def exit_code(self) -> int:
        """The conventional exit status of a process the signal ended: 128 + its number."""
        return 128 + (self.signum or 0)

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "none"

    def listen(self, folder: str | None) -> None:
        """Take requests from the supervisor's STOP_FILE in `folder`, or, without one, from SIGTERM
        and SIGINT (the process's main thread only: where Python runs signal handlers)."""
        if folder:
            threading.Thread(
                target=self._watch, args=(Path(folder) / STOP_FILE,), name="stop", daemon=True
            ).start()
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Put back the handlers `listen` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame) -> None:
        if self.signum is None:
            self.signum, self._at = signum, time.monotonic()
        elif time.monotonic() - self._at >= DUPLICATE_S:  # asked again: no more waiting for the step
            self.restore()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _watch(self, path: Path) -> None:
        while self.signum is None:
            try:
                self.signum = int(path.read_text().strip() or signal.SIGTERM)
            except (FileNotFoundError, ValueError):
                time.sleep(POLL_S)


def request_stop(folder: Path, signum: int) -> None:
    """The supervisor's side: ask the workers publishing in `folder` to stop after their step."""
    tmp = folder / f"{STOP_FILE}.tmp"
    tmp.write_text(str(int(signum)))
    tmp.replace(folder / STOP_FILE)


current = StopRequest()  # this process's; read by the trainer at each step's all-reduce
