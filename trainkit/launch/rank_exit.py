"""How a rank's life ends: a lost peer recognised and named, and an exit that a launched rank survives."""

from __future__ import annotations

import atexit
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch

from trainkit.errors import CONTINUE, TrainingError

# What a collective raises when another rank is gone: gloo (a plain RuntimeError) and NCCL / the store (DistError).
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
              "NCCL communicator was aborted", "Socket Timeout")

_ROLL, _ROLL_CALL_S = "trainkit/roll", 3.0  # the store's keys of the roll call, and how long it waits for answers
_KEPT: list[object] = []  # what keep_until_exit holds: never released


def lost_peer(error: BaseException) -> bool:
    """Whether a collective failed because another rank died, froze or lost its network."""
    return isinstance(error, torch.distributed.DistError) or any(s in _first_line(error) for s in _LOST_PEER)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class LostContact(TrainingError):
    """This rank stopped because another did (lost_contact): an effect, never published as a cause."""


def lost_contact(error: BaseException) -> LostContact | None:
    """The error to report when a collective failed because another rank died, froze or lost its network, else None;
    it names the ranks that did not answer the roll call (_unanswered).

    gloo's message starts with its source file ("[.../pair.cc:537] Read error [IP]:PORT: Connection reset by peer.
    This is typically caused by ..."): the part that says what happened is kept.
    """
    if not lost_peer(error):
        return None
    rank = os.environ.get("RANK", "0")
    if failed := _failures():  # a rank that ended on an error of its own is not silent: its error is the cause
        return LostContact(f"rank {rank} stopped because {failed[0]} ended the run", failed[1])
    reason = re.sub(r"^\[[^\]]*\]\s*", "", _first_line(error)).split(". This is typically")[0]
    missing = _unanswered()
    silent = f"; {', '.join(missing)} did not answer within {_ROLL_CALL_S:g} s (dead, frozen or cut off)" \
        if missing else ""
    return LostContact(f"rank {rank} lost contact with the other processes ({reason}){silent}",
                         f"a machine or process died, froze or lost its network. Check the other machines' logs, then "
                         f"{CONTINUE}")


def answer_roll_call() -> None:
    """Each rank of a launch writes where it runs (host, machine, pid) into the launch's store at its start, for
    lost_contact's roll call to name a rank that stops answering."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        where = f"on {socket.gethostname()} (machine {os.environ.get('GROUP_RANK', '0')}), pid {os.getpid()}"
        _store().set(f"{_ROLL}/where/{dist.get_rank()}", where)


def publish_failure(line: str) -> None:
    """Before a rank ends on an error: the error's line, into the launch's store, for the ranks that then lose contact
    with it to say what ended the run instead of naming it as gone silent (lost_contact). The store is torchrun's
    agent's, so it outlives this rank."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            _store().set(f"{_ROLL}/failed/{dist.get_rank()}", line)
        except Exception:  # noqa: BLE001 - a store out of reach: the other ranks fall back to the roll call
            pass


def _failures() -> tuple[str, str] | None:
    """The first rank (by number) that published its error, with where it ran, and the error; None if none did or the
    store cannot be read."""
    import datetime

    import torch.distributed as dist

    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=_ROLL_CALL_S))
        for r in range(dist.get_world_size()):
            if store.check([f"{_ROLL}/failed/{r}"]):
                where = store.get(f"{_ROLL}/where/{r}").decode() if store.check([f"{_ROLL}/where/{r}"]) else ""
                return f"rank {r} {where}".strip(), store.get(f"{_ROLL}/failed/{r}").decode()
    except Exception:  # noqa: BLE001 - a store that fails too leaves the roll call to say what it can
        return None
    return None


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()  # the launch's (under a restart, its attempt's: accelerator.join_restarted_group)


def _unanswered(wait_s: float = _ROLL_CALL_S) -> list[str] | None:
    """After a collective failed: every rank that still runs says so in the store; the ranks that have not after
    wait_s (dead, frozen, or cut off from the store) are named with where they ran. None where the store cannot be
    read (the machine holding it is gone, or no process group)."""
    import datetime

    import torch.distributed as dist

    try:
        store, world = _store(), dist.get_world_size()
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        store.set(f"{_ROLL}/answered/{dist.get_rank()}", "1")
        deadline, missing = time.monotonic() + wait_s, list(range(world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{_ROLL}/answered/{r}"])]
            time.sleep(0.1)
        return [f"rank {r} " + (store.get(f"{_ROLL}/where/{r}").decode() if store.check([f"{_ROLL}/where/{r}"])
                                else "(where unknown)") for r in missing]
    except Exception:  # noqa: BLE001 - a store that fails too leaves the message as it was
        return None


def _launched() -> bool:
    """Whether a launcher (accelerate launch, torchrun, DeepSpeed's) started this process as one of its ranks."""
    return "LOCAL_RANK" in os.environ


def end_with_launcher() -> None:
    """A launched rank ends (SIGKILL) when the process that started it dies, as a lost peer then ends the others.

    torchrun starts each rank in a session of its own, so a launcher killed alone (SIGKILL of one machine's
    `accelerate launch`) left its ranks running as orphans: measured on two loopback machines, the orphan trained on,
    and the other machine waited at torchrun's exit barrier for 300 s and then exited 0. Linux's parent-death signal
    (prctl PR_SET_PDEATHSIG) ends the rank with its launcher instead; the other ranks then lose contact within seconds
    and say so (tests/test_multinode.py). A launcher that died before this call left the rank to init (pid 1): it
    ends at once, unless pid 1 is a Python process, the launcher itself as a container's entry point."""
    if not _launched() or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1  # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1 and b"python" not in _command_line(1):
        os.kill(os.getpid(), signal.SIGKILL)


def outlive_its_terminal() -> None:
    """A launched rank's output goes to /dev/null once nothing reads it any more, instead of ending the rank.

    DeepSpeed's pdsh runner, asked to stop (a scheduler's SIGTERM through `python -m trainkit.launch.hostfile`), ends
    pdsh and with it every host's ssh session a second later, and then has each host's launcher pass SIGTERM to its
    ranks. The ranks stop at one step and save, but their stdout is the closed session: the next print raised
    BrokenPipeError and the rank died mid-checkpoint (measured: no checkpoint, no stopped.json, exit 241)."""
    if _launched():
        sys.stdout, sys.stderr = _Output(sys.stdout), _Output(sys.stderr)


class _Output:
    """A text stream whose reader may go away: writing to it then goes nowhere."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        self._stream = open(os.devnull, "w")  # noqa: SIM115 (kept until exit, as sys.stdout is)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _command_line(pid: int) -> bytes:
    """The command line of process `pid`, or b"python" where it cannot be read (then nothing is ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b"python"


def keep_until_exit(engine: object) -> None:
    """A launched rank never frees its engine (the prepared model, optimizer and their process groups).

    After Accelerate's end_training has destroyed the process group, the DDP model's Reducer holds its last reference:
    freeing the model (when main() returns) runs ~ProcessGroupGloo from pybind11's dealloc, which keeps the GIL while it
    joins the group's worker threads, and a worker still dropping its last finished work (tensors with Python objects)
    waits for that GIL. Both wait forever: seen here as a DDP rank that wrote final/ and never exited (the kind of
    destructor pytorch/pytorch#56297 lists). end_process skips finalization, so what is kept here is never freed.
    """
    if _launched():
        _KEPT.append(engine)


def end_process(code: int) -> NoReturn:
    """Exit with `code`; a rank started by a launcher skips interpreter finalization.

    destroy_process_group does not free torch 2.13's gloo groups while anything still holds them (ZeRO-3 tags every
    parameter with its group), so their worker threads live until finalization, where dropping the tensors they hold
    races the interpreter's teardown: a finished rank aborts with "terminate called without an active exception"
    and the launcher reports the run failed (1 of 68 ZeRO-3 runs here, and in CI; pytorch/pytorch#190489, open).
    Everything else that a normal exit does still happens: the atexit handlers run, the streams are flushed.
    """
    if not _launched():
        sys.exit(code)
    atexit._run_exitfuncs()  # logging.shutdown and every library's own handlers, while the interpreter is whole
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
