"""End a python stub whose tritonserver is gone.

Triton's python stub checks on its parent from a thread that first takes a lock in shared
memory. When tritonserver dies holding that lock (killed, or crashed), the check blocks forever
and the stub lives on as an orphan. Measured with 2.51: after a SIGKILL to the server, the
engine model's stub, holding the model in memory (on a GPU, its memory), stayed for good, and
a watchdog thread inside the stub could not help: every thread was blocked, the GIL held by one
waiting on that lock. So each of our models starts `exit_with_server`: a tiny shell process that
checks both processes every second and, once the server is gone, kills the stub and removes its
shared-memory region (nobody else will). It ends by itself when the stub ends.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
# A zombie (dead, not yet reaped) counts as gone; `read` is a builtin, so a check forks nothing.
_WATCH = ('alive() { read -r _ _ state _ < "/proc/$1/stat" && [ "$state" != Z ]; }; '
          'while alive "$1" && alive "$2"; do sleep 1; done; '
          'if alive "$2"; then kill -9 "$2"; rm -f "$3"; fi')


def _stub_region() -> Path | None:
    """The stub's shared-memory region: its command line is
    `triton_python_backend_stub MODEL_PY REGION_NAME ...`."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if len(args) < 3 or not args[0].decode(errors="replace").endswith(STUB_BINARY):
        return None
    name = args[2].decode(errors="replace")
    return Path("/dev/shm") / name if name and "/" not in name else None


def exit_with_server() -> None:
    """Start the watch; call once from a model's `initialize`. Outside a python stub (tests
    that load an adapter in process) it does nothing."""
    region = _stub_region()
    if region is None:
        return
    subprocess.Popen(["sh", "-c", _WATCH, "inflight-lifeline", str(os.getppid()), str(os.getpid()),
                      str(region)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def skip_teardown_at_exit() -> None:
    """Call from a model's `finalize`: the stub then leaves without tearing its interpreter
    down. The teardown after transformers is loaded (modules, tokenizers) took 15-30 s on a
    busy 2-core machine, and Triton waits for the stub the whole time: preprocessing and
    postprocessing alone used up its 30 s exit timeout at every shutdown. By the time atexit
    handlers run the stub has answered Triton's finalize message and Triton owns the shared
    memory, so nothing is left to clean up that a normal exit would."""
    import atexit

    atexit.register(os._exit, 0)

