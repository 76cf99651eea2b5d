"""Process identity with real processes (infra/process.py): a live process is itself, a dead, zombie or reused pid
is not, start times match what older versions recorded from /proc by hand, and stopping touches only the recorded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.stack.procs import Proc, is_ours, stop
from infra import process
from infra.head import HeadInfo, _recorded_alive, stop_head
from infra.run_owner import owner_alive


def _kernel_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat, read as every version before infra.process did."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    # Popen returns after fork; until the child has exec'd, /proc shows Python's empty cmdline (a fresh clone's
    # run read () here once)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes() != b"sleep\x0060\x00" and time.monotonic() < deadline:
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_process_reads_as_itself(sleeper):
    info = process.inspect(sleeper.pid)
    assert info is not None and info.pid == sleeper.pid and info.ppid == os.getpid()
    assert info.cmdline == ("sleep", "60") and info.pgid == os.getpgid(os.getpid())  # Popen keeps our group
    assert info.start_ticks == _kernel_ticks(sleeper.pid)  # what older state files and owner tags hold
    assert process.is_same(sleeper.pid, info.start_ticks) and process.is_same(sleeper.pid, str(info.start_ticks))
    assert not process.is_same(sleeper.pid, info.start_ticks + 1)  # another process with the same pid


def test_start_ticks_match_the_kernel_for_every_process():
    infos = process.processes()
    checked = [i for i in infos if Path(f"/proc/{i.pid}").exists() and _kernel_ticks(i.pid) == i.start_ticks]
    assert len(infos) > 3 and len(checked) >= len(infos) - 2  # at most a couple exited between the two reads
    assert os.getpid() in {i.pid for i in infos}


def test_dead_and_zombie_processes_are_gone():
    proc = subprocess.Popen(["sleep", "60"])
    ticks = process.inspect(proc.pid).start_ticks
    proc.kill()
    deadline = time.monotonic() + 10
    while "Z" not in Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1][:3]:  # not yet waited for
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert process.inspect(proc.pid) is None and not process.is_same(proc.pid, ticks)  # a zombie runs nothing
    proc.wait()
    assert process.inspect(proc.pid) is None and not process.is_same(proc.pid, ticks)
    assert process.inspect(0) is None and process.inspect(-1) is None  # process groups, never one process


def _reuse_pid(pid: int) -> subprocess.Popen | None:
    """A new process that gets `pid` (via ns_last_pid, root only); None when the kernel did not hand it out."""
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(pid - 1))
    except OSError:
        return None
    proc = subprocess.Popen(["sleep", "60"])
    if proc.pid == pid:
        return proc
    proc.kill()
    proc.wait()
    return None


def test_a_reused_pid_is_not_the_recorded_process():
    for _ in range(5):  # another process of the host may take the pid first: try again
        first = subprocess.Popen(["sleep", "60"])
        recorded = process.inspect(first.pid)
        first.kill()
        first.wait()
        time.sleep(0.02)  # at least one clock tick, so the two start times differ
        second = _reuse_pid(first.pid)
        if second is not None:
            break
    else:
        pytest.skip("cannot make the kernel reuse a pid here (needs root and /proc/sys/kernel/ns_last_pid)")
    try:
        assert process.inspect(second.pid) is not None  # the pid is alive ...
        assert not process.is_same(recorded.pid, recorded.start_ticks)  # ... but it is not the recorded process
        stacked = Proc(pid=recorded.pid, start_ticks=recorded.start_ticks)
        assert not is_ours(stacked) and stop(stacked) is False  # `shardline down` leaves it alone
        owner = f"{socket.gethostname()}/{process.boot_id()}/{recorded.pid}/{recorded.start_ticks}"
        assert owner_alive(owner) is False  # and its runs would count as orphaned
        time.sleep(0.1)
        assert second.poll() is None
    finally:
        second.kill()
        second.wait()


def test_descendants_follow_the_tree_and_leave_the_caller_out():
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(process.descendants([shell.pid])) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        below = process.descendants([shell.pid])
        assert shell.pid in below and len(below) == 3
        assert all(process.inspect(p).cmdline[0] in ("sh", "sleep") for p in below)
        assert process.descendants([os.getpid()]) and os.getpid() not in process.descendants([os.getpid()])
    finally:
        process.terminate(process.descendants([shell.pid]), wait_s=5)
        shell.wait()


def test_terminate_kills_what_ignores_sigterm_and_nothing_else(sleeper):
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    stubborn.stdout.readline()  # SIGTERM is ignored from here on
    started = time.monotonic()
    assert process.terminate([stubborn.pid], wait_s=0.5) == []
    assert stubborn.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - started >= 0.5
    assert sleeper.poll() is None


def _head_record(pids: list[int], start_ticks: list[int]) -> HeadInfo:
    return HeadInfo(
        gcs_address="127.0.0.1:1",
        dashboard_url="http://127.0.0.1:2",
        pids=pids,
        start_ticks=start_ticks,
        host="127.0.0.1",
        num_cpus=1,
        started_at=0.0,
    )


def test_head_record_counts_a_pid_only_while_it_is_the_recorded_process(sleeper, tmp_path, monkeypatch):
    ticks = process.inspect(sleeper.pid).start_ticks
    assert _recorded_alive(_head_record([sleeper.pid], [ticks])) == [sleeper.pid]
    assert _recorded_alive(_head_record([sleeper.pid], [ticks - 1])) == []  # the pid went to another process
    # a record of an older version has no start times: a pid counts only while it is a Ray process of the head's
    # GCS port, which a sleep is not
    assert _recorded_alive(_head_record([sleeper.pid], [])) == []
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "head.json").write_text(_head_record([sleeper.pid], [ticks - 1]).model_dump_json())
    assert stop_head() is True  # the record is dropped ...
    time.sleep(0.2)
    assert sleeper.poll() is None and not (tmp_path / "ray" / "head.json").exists()  # ... the reused pid lives on
