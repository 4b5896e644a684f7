"""tools.recovery: the launcher's restart budget and backoff, and which /dev/shm leftovers
are safe to remove while other servers run beside it."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.recovery import (
    RestartPolicy,
    describe_exit,
    group_is_alive,
    is_running,
    python_stubs,
    remove_own_shm,
    remove_stale_shm,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")


def test_backoff_doubles_up_to_its_cap_then_the_budget_runs_out():
    policy = RestartPolicy(max_restarts=5, window_s=600, first_delay_s=1, max_delay_s=5)
    assert [policy.next_delay_s(t) for t in range(6)] == [1, 2, 4, 5, 5, None]
    assert policy.num_recent == 5


def test_restarts_older_than_the_window_are_forgotten():
    policy = RestartPolicy(max_restarts=2, window_s=100, first_delay_s=1)
    assert policy.next_delay_s(0) == 1
    assert policy.next_delay_s(50) == 2
    assert policy.next_delay_s(99) is None  # 2 within the last 100 s
    assert policy.next_delay_s(100) == 2  # the one at 0 has left the window; the one at 50 has not
    assert policy.next_delay_s(300) == 1  # a crash long after the others starts over


def test_no_restarts_allowed_gives_up_at_once():
    assert RestartPolicy(max_restarts=0, window_s=600).next_delay_s(0) is None
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=1, window_s=0)


def test_exits_are_described_by_code_or_signal():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-11) == "signal SIGSEGV"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_files_of_servers_that_are_gone_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    files = {name: tmp_path / name for name in [
        f"inflight{dead}_aaaa",  # its launcher is dead and nothing maps it: stale
        f"inflight{alive}_bbbb",  # its launcher lives (its server may be between two runs)
        "inflighttest1234_cccc",  # no pid in the name, nothing holds it: stale
        "inflighttest1235_mapped",  # no pid, but a live server maps it
        f"inflight{dead}_open",  # a dead launcher's name, but something still has it open
        "other_dddd",  # not ours to judge
    ]}
    for path in files.values():
        path.write_bytes(b"\0" * 4096)
    with open(files["inflighttest1235_mapped"], "r+b") as mapped_file:
        region = mmap.mmap(mapped_file.fileno(), 4096)  # mapped, then the fd closed, as boost does
    held = open(files[f"inflight{dead}_open"], "rb")  # noqa: SIM115
    try:
        removed = remove_stale_shm(tmp_path)
    finally:
        region.close()
        held.close()
    assert sorted(p.name for p in removed) == sorted([f"inflight{dead}_aaaa", "inflighttest1234_cccc"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["inflight%d_bbbb" % alive, "inflighttest1235_mapped", f"inflight{dead}_open", "other_dddd"])


def test_own_files_go_after_the_server_exits_but_not_while_used(tmp_path):
    prefix = f"inflight{os.getpid()}_"  # the launcher is alive: its own files still go
    (tmp_path / f"{prefix}gone").write_bytes(b"x")
    (tmp_path / f"{prefix}used").write_bytes(b"x")
    (tmp_path / f"inflight{os.getpid()}1_other").write_bytes(b"x")  # another prefix
    with open(tmp_path / f"{prefix}used", "rb"):
        removed = remove_own_shm(prefix, tmp_path)
    assert [p.name for p in removed] == [f"{prefix}gone"]


def test_a_process_group_is_alive_until_its_last_member_exits():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert group_is_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not group_is_alive(child.pid)


def _fake_process(proc: Path, pid: int, ppid: int, argv: list[str], state: str = "S") -> None:
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "stat").write_text(f"{pid} (a (b)) {state} {ppid} {pid} 0 0\n")
    (proc / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")


def test_the_stubs_of_a_server_are_found_by_model_and_a_zombie_is_not_running(tmp_path):
    """The launcher restarts a server whose python stub stopped: Triton 2.51 keeps answering
    ready while that model fails every request."""
    stub = "/tmp/x/backends/python/triton_python_backend_stub"
    _fake_process(tmp_path, 10, 1, ["tritonserver", "--model-repository=/r"])
    _fake_process(tmp_path, 11, 10, [stub, "/r/preprocessing/1/model.py", "prefix", "1048576"])
    _fake_process(tmp_path, 12, 10, [stub, "/r/tensorrt_llm/1/model.py", "prefix", "1048576"])
    _fake_process(tmp_path, 13, 10, [stub, "/r/postprocessing/1/model.py"], state="Z")  # dead, unreaped
    _fake_process(tmp_path, 14, 11, ["python", "-m", "inflight.hosts.engine_process"])  # a grandchild
    _fake_process(tmp_path, 15, 99, [stub, "/other/preprocessing/1/model.py"])  # another server's
    assert python_stubs(10, tmp_path) == {11: "preprocessing", 12: "tensorrt_llm"}
    assert is_running(11, tmp_path) and not is_running(13, tmp_path) and not is_running(16, tmp_path)
