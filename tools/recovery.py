"""Coming back after a crash: when to restart a server, and which leftovers of dead servers to
remove. Pure Python, no torch; used by tools/launch_triton_server.py.

`RestartPolicy` decides whether a server that died unexpectedly is restarted and after how
long: exponential backoff (`first_delay_s`, doubled for each restart still inside the window, up
to `max_delay_s`) and at most `max_restarts` restarts within any `window_s` seconds. Restarts
older than the window are forgotten, so a server that crashes once a day is always restarted
after the first delay.

`remove_stale_shm` removes the python backend's shared-memory files that a crashed server left
in /dev/shm (each region is `<prefix><uuid>`; the launcher's prefix is `inflight<pid>_`, where
<pid> is the launcher's). Several servers may run side by side on one machine, each with its own
prefix, so a file is removed only when nothing can still be using it:
- it is ours (only its owner may remove a file in /dev/shm, which is sticky);
- no process has it open or mapped (read from /proc/<pid>/fd and /proc/<pid>/maps: the server
  keeps its regions mapped for as long as a model is loaded, and its stubs do too);
- and, where the name carries a pid (`inflight<pid>_...`), that process is gone.
The second rule alone covers any prefix (the tests' `inflighttest<port>_` too); the third keeps
the files of a launcher that is alive but whose server is between two runs.
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "inflight"
_PID_IN_NAME = re.compile(rf"{SHM_PREFIX}(\d+)_")


class RestartPolicy:
    """Backoff and a restart budget. `next_delay_s(now_s)` is called once per unexpected exit:
    it records a restart and returns how long to wait before it, or None when the budget is
    spent (the caller then gives up). Not thread-safe; times are time.monotonic() seconds."""

    def __init__(self, max_restarts: int, window_s: float, first_delay_s: float = 1.0,
                 max_delay_s: float = 30.0):
        if max_restarts < 0 or window_s <= 0 or first_delay_s < 0 or max_delay_s < first_delay_s:
            raise ValueError("need max_restarts >= 0, window_s > 0 and 0 <= first_delay_s <= max_delay_s")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self._restarts_s: deque[float] = deque()  # when each restart inside the window was asked

    @property
    def num_recent(self) -> int:
        """Restarts recorded inside the window, as of the last call."""
        return len(self._restarts_s)

    def next_delay_s(self, now_s: float) -> float | None:
        while self._restarts_s and now_s - self._restarts_s[0] >= self.window_s:
            self._restarts_s.popleft()
        if len(self._restarts_s) >= self.max_restarts:
            return None
        delay_s = min(self.first_delay_s * 2 ** len(self._restarts_s), self.max_delay_s)
        self._restarts_s.append(now_s)
        return delay_s


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL' for a Popen returncode."""
    import signal

    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def group_is_alive(pgid: int, proc_dir: Path = Path("/proc")) -> bool:
    """Whether a process group still has a member that is not a zombie (a zombie holds no
    memory or files, and an init that does not reap would keep it for ever)."""
    if not proc_dir.is_dir():  # not Linux: a zombie counts
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for proc in proc_dir.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            state, _, group = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def _stat_fields(pid: int, proc_dir: Path = Path("/proc")) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command (state, ppid, pgrp, ...), or None."""
    try:
        return (proc_dir / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_running(pid: int, proc_dir: Path = Path("/proc")) -> bool:
    """The process exists and is not a zombie (a dead child its parent has not reaped yet)."""
    fields = _stat_fields(pid, proc_dir)
    return fields is not None and fields[0] != "Z"


def python_stubs(server_pid: int, proc_dir: Path = Path("/proc")) -> dict[int, str]:
    """The python backend stubs a tritonserver runs: pid -> the name of the model it serves
    (read from the stub's `.../<model>/<version>/model.py` argument)."""
    stubs = {}
    for proc in proc_dir.iterdir():
        fields = _stat_fields(int(proc.name), proc_dir) if proc.name.isdigit() else None
        if fields is None or int(fields[1]) != server_pid or fields[0] == "Z":
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and argv[0].endswith("triton_python_backend_stub"):
            stubs[int(proc.name)] = next((Path(a).parent.parent.name for a in argv if a.endswith("model.py")), "?")
    return stubs


def _in_use(paths: set[str], proc_dir: Path = Path("/proc")) -> set[str]:
    """Those of `paths` that some process we may inspect has open or mapped. A process's fds are
    read before its maps: a region is mapped before its creator closes the fd, so a file never
    slips between the two reads."""
    used: set[str] = set()
    for proc in proc_dir.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target in paths:
                    used.add(target)
            with open(proc / "maps", errors="replace") as maps:
                for line in maps:
                    target = line.rstrip("\n").partition("/")[2]
                    if target and "/" + target.removesuffix(" (deleted)") in paths:
                        used.add("/" + target.removesuffix(" (deleted)"))
        except OSError:  # gone, or another user's: it cannot hold files we may remove
            continue
    return used


def stale_shm_files(shm_dir: Path = SHM_DIR, prefix: str = SHM_PREFIX,
                    check_pid: bool = True) -> list[Path]:
    """The files under `shm_dir` whose name starts with `prefix` and that no live server can be
    using (the rules in the module docstring; `check_pid=False` skips the pid in the name, for
    the caller's own prefix)."""
    uid = os.getuid()
    candidates = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return []
    for path in entries:
        if not path.name.startswith(prefix):
            continue
        try:
            if path.lstat().st_uid != uid or not path.is_file():
                continue
        except OSError:
            continue
        match = _PID_IN_NAME.match(path.name)
        if check_pid and match and _pid_alive(int(match.group(1))):
            continue
        candidates.append(path)
    if not candidates:
        return []
    used = _in_use({str(p) for p in candidates})
    return [p for p in candidates if str(p) not in used]


def remove_files(paths: Iterable[Path]) -> list[Path]:
    """Remove each path; the ones actually removed (another may have gone already)."""
    removed = []
    for path in paths:
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def remove_stale_shm(shm_dir: Path = SHM_DIR, prefix: str = SHM_PREFIX) -> list[Path]:
    return remove_files(stale_shm_files(shm_dir, prefix))


def remove_own_shm(prefix: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """After our own server has exited and its process group is gone: the regions it left, by
    its prefix, unless some process still uses one (a prefix given by hand may be shared)."""
    return remove_files(stale_shm_files(shm_dir, prefix, check_pid=False))
