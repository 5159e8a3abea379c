"""The run's output folder: what a new run may write over (nothing, unasked), one run at a time in it, every machine
seeing it, and the record a stop leaves there. The checkpoints inside it are trainkit/run/checkpoint.py's."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from contextlib import suppress
from pathlib import Path
from typing import Any

from trainkit.errors import ConfigError, Problem, write_failure
from trainkit.run.checkpoint import has_latest, write_atomically


def check_output_dir(output_dir: Path, resume: str | None, overwrite: bool) -> list[Problem]:
    """Problems with writing into output_dir. A new run never writes over an earlier one unless told --overwrite;
    the advice names only what can work for what the folder holds."""
    if output_dir.exists() and not output_dir.is_dir():
        return [Problem(f"{output_dir} is a file, not a folder", "--output_dir",
                        "pass the path of a folder (it is created if missing)")]
    writable = next(p for p in (output_dir, *output_dir.absolute().parents) if p.exists())
    if not os.access(writable, os.W_OK | os.X_OK):
        if os.statvfs(writable).f_flag & os.ST_RDONLY:  # no permission mends a read-only mount
            return [Problem(f"cannot write in {writable}: its file system is mounted read-only", "--output_dir",
                            "pass an --output_dir on a writable file system")]
        return [Problem(f"cannot write in {writable}", "--output_dir",
                        "pass a folder you can write to, or fix its permissions")]
    if resume is not None:
        return [Problem("--resume and --overwrite contradict each other", "command line", "pass only one")] \
            if overwrite else []
    existing = [name for name in ("checkpoints", "metrics.jsonl", "final") if (output_dir / name).exists()]
    if not existing or overwrite:
        return []
    if (output_dir / "final").exists():
        fix = "pass --overwrite to replace it, or a new --output_dir" + (
            " (or --resume latest with a larger --max_steps to train it further)" if has_latest(output_dir) else "")
    elif has_latest(output_dir):
        fix = "pass --resume latest to continue it, --overwrite to replace it, or a new --output_dir"
    else:
        return [Problem(f"{output_dir} already holds a run that stopped before its first checkpoint "
                        f"({', '.join(existing)})", "--output_dir",
                        "pass --overwrite to start it again, or a new --output_dir")]
    return [Problem(f"{output_dir} already holds a run ({', '.join(existing)})", "--output_dir", fix)]


LOCK_FILE = ".trainkit.lock"
_HELD: list[Any] = []  # the lock files this process holds: open until it ends


def lock_output_dir(output_dir: Path, hold: bool) -> list[Problem]:
    """One run at a time in an output folder. The launch's first process takes an exclusive lock on
    output_dir/.trainkit.lock and keeps it until it ends (the system frees it however the process ends, so it never
    goes stale); another run there (a second launch by mistake, or an --overwrite that would delete the first one's
    checkpoints) is refused. hold=False (--dry_run) only tries it."""
    path = output_dir / LOCK_FILE
    if not (hold or path.exists()):
        return []
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        file = open(path, "a+")  # held open past this function: the lock lives as long as the file
    except OSError as e:
        return [_unwritable(output_dir, e)]
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "a process"
        file.close()
        return [Problem(f"another run is writing in {output_dir} ({holder})", "--output_dir",
                        "let it end or stop it (its checkpoints stay whole), or pass another --output_dir")]
    if not hold:
        file.close()  # closing releases it
        return []
    try:
        file.truncate(0)
        file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
    except OSError as e:
        with suppress(OSError):  # closing flushes, and fails alike
            file.close()
        return [_unwritable(output_dir, e)]
    _HELD.append(file)
    return []


def _unwritable(output_dir: Path, error: OSError) -> Problem:
    what, fix = write_failure(error, output_dir)
    return Problem(f"cannot write in {output_dir}: {what}", "--output_dir", f"{fix}, or pass another --output_dir")


def check_folder_shared(output_dir: Path) -> None:
    """Every rank must see the output folder that rank 0 writes: each writes its own checkpoint shards there, and rank
    0 renames the whole. On machines that do not share it, the first save would fail (as a full disk, and only
    then). Rank 0's lock file (lock_output_dir) is the marker: the others read it and compare it with what rank 0
    wrote there, passed to them in one collective; every rank then refuses alike, naming the ranks that see another
    folder."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    path = output_dir / LOCK_FILE
    written = [path.read_text() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(written, src=0)
    try:
        seen = path.read_text() == written[0]
    except OSError:
        seen = False
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (seen, socket.gethostname()))
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(ranks) if not ok]
    if blind:
        raise ConfigError([Problem(
            f"{', '.join(blind)} cannot see {output_dir} as rank 0 on {ranks[0][1]} writes it (its "
            f"{LOCK_FILE} is missing or another there)", "--output_dir",
            "pass an --output_dir on a file system that every machine mounts at the same path (NFS, Lustre, a "
            "cluster's shared home): every rank writes its part of each checkpoint there")])


def clear_outputs(output_dir: Path) -> None:
    """Remove an earlier run's outputs (--overwrite): stale checkpoints would otherwise mix with the new ones."""
    for folder in ("checkpoints", "final", "train", "universal"):  # train/: TensorBoard's events
        shutil.rmtree(output_dir / folder, ignore_errors=True)
    for name in ("metrics.jsonl", "resolved_config.json", "generations.jsonl", STOP_RECORD):
        (output_dir / name).unlink(missing_ok=True)


# Written by rank 0 when a run stops early with a checkpoint (a signal, --stop_at), and removed when a launch starts:
# a scheduler's script tells a preemption from a crash by it, whatever the launcher's exit status (torchrun exits 1
# after forwarding a SIGTERM, even when every rank stopped cleanly).
STOP_RECORD = "stopped.json"


def record_stop(output_dir: Path, step: int, stopped_by: str, max_steps: int, checkpoint: Path) -> None:
    """STOP_RECORD for a stop after `step`: what stopped the run, where it stands, and how to continue it."""
    record = {"stopped_by": stopped_by, "step": step, "max_steps": max_steps,
              "checkpoint": str(checkpoint), "continue_with": "--resume auto"}
    write_atomically(output_dir / STOP_RECORD, json.dumps(record, indent=2) + "\n")
