"""Resident memory of a server's process tree, sampled in the background (Linux /proc).

    with ProcessMemory([server_pid, frontend_pid]) as memory:
        ...                      # the load or the attacks
    print(memory.report())      # idle, peak and growth of each process, in MiB

Each sample walks the descendants of the root pids (tritonserver's python stubs and the engine
process under it; a launcher's restarted servers too) and keeps, per process, its resident size
at the first sample it was seen in (its idle size, when sampling starts at idle) and its peak.
A process is named by its role: tritonserver, the stub of model X, the engine process, the
OpenAI frontend, or its command's first word.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


@dataclass
class Usage:
    name: str
    idle_bytes: int
    peak_bytes: int

    @property
    def growth_bytes(self) -> int:
        return self.peak_bytes - self.idle_bytes


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The command may hold spaces and parentheses: the fields follow its last ')'.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _rss_bytes(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


def process_name(pid: int) -> str:
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    words = [a.decode(errors="replace") for a in argv if a]
    text = " ".join(words)
    if not words:
        return f"pid {pid}"
    if "triton_python_backend_stub" in text:
        model = next((Path(w).parent.parent.name for w in words if w.endswith("model.py")), "?")
        return f"stub {model}"
    if "engine_process" in text:
        return "engine process"
    if "openai_frontend" in text:
        return "OpenAI frontend"
    return Path(words[0]).name


class ProcessMemory:
    """Samples the process trees under `root_pids` every `period_s` while its block runs."""

    def __init__(self, root_pids: list[int], period_s: float = 0.2):
        self.root_pids = list(root_pids)
        self.period_s = period_s
        self.usage: dict[int, Usage] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProcessMemory":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        children = _children_by_parent()
        pending = list(self.root_pids)
        while pending:
            pid = pending.pop()
            pending += children.get(pid, [])
            rss = _rss_bytes(pid)
            if rss is None:
                continue
            if pid not in self.usage:
                self.usage[pid] = Usage(process_name(pid), rss, rss)
            self.usage[pid].peak_bytes = max(self.usage[pid].peak_bytes, rss)

    def max_growth_bytes(self) -> int:
        return max((u.growth_bytes for u in self.usage.values()), default=0)

    def report(self, min_peak_bytes: int = 16 * MIB, peaks_only: bool = False) -> list[str]:
        """A line per process that reached `min_peak_bytes`, largest growth (or peak) first,
        then how many smaller ones there were (helpers such as `sh` and `sleep`). `peaks_only`
        for processes that started while sampling ran, whose first sample is no idle size."""
        large = sorted(((pid, u) for pid, u in self.usage.items() if u.peak_bytes >= min_peak_bytes),
                       key=lambda item: -(item[1].peak_bytes if peaks_only else item[1].growth_bytes))
        lines = [f"{u.name} (pid {pid}): peak {u.peak_bytes / MIB:.0f} MiB" if peaks_only else
                 f"{u.name} (pid {pid}): idle {u.idle_bytes / MIB:.0f} MiB, peak {u.peak_bytes / MIB:.0f} MiB, "
                 f"growth {u.growth_bytes / MIB:+.0f} MiB" for pid, u in large]
        num_small = len(self.usage) - len(large)
        return lines + ([f"{num_small} processes below {min_peak_bytes // MIB} MiB"] if num_small else [])
