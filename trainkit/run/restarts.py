"""A launch's attempts under torchrun's restarts (`accelerate launch --max_restarts N`): what a failed attempt leaves
for torchrun's report and for the next attempt.

torchrun gives each rank of each attempt a reply file (TORCHELASTIC_ERROR_FILE, under attempt_<k>/<local rank>/ of
the launch's log folder). Its report at the end of a failed launch shows what the file says as the failure's cause,
instead of "To enable traceback see ...". A refusal (exit 2: a broken recipe, a wrong flag) fails the same way in
every attempt, and torchrun restarts it all the same: the next attempt finds it in the previous attempt's file and
ends at once, before train.py's imports (seconds of torch), so the remaining restarts pass in a second.

Imports only the standard library: train.py calls `end_if_refused_before` before its own imports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

_ENDED_AT_ONCE = "attempt"  # how end_if_refused_before's own line starts: not repeated from one attempt to the next


def attempt() -> tuple[int, int] | None:
    """(this attempt, counted from 1; the most the launch allows), or None outside torchrun or without restarts."""
    count, most = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if count is None or not most.isdigit() or int(most) == 0:
        return None
    return int(count) + 1, int(most) + 1


def last_attempt_note(continue_from: Callable[[], str]) -> str | None:
    """The line that says a launch's restarts are used up, or None where more attempts follow (or none were asked).
    continue_from: where the run goes on from, in words; asked only on the last attempt (it reads the checkpoints)."""
    now = attempt()
    if now is None or now[0] < now[1]:
        return None
    return (f"the launch ends: attempt {now[0]} of {now[1]} failed (--max_restarts {now[1] - 1} used up); the cause "
            f"is the error above; {continue_from()}")


def record_error(lines: list[str], refusal: bool) -> None:
    """This rank's error into torchrun's reply file: its report then names it. A refusal is marked for the next
    attempt (end_if_refused_before)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = "\n".join(f"error: {line}" for line in lines)
    try:
        Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time()), "refusal": refusal}))
    except OSError:  # a full disk there too: torchrun's report says what it can
        pass


def rank_zero_first() -> None:
    """The ranks of a launch mostly fail alike, and the launcher stops every rank when one fails: rank 0 goes on at
    once, the others only after a pause, by which time the launcher has ended them if rank 0 failed too. So rank 0
    says a shared error, and a rank that alone met it still says it: never a silent failure, never N copies."""
    if int(os.environ.get("RANK", "0")) > 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's stop ends this pause, and the process
        time.sleep(5)


def end_if_refused_before() -> None:
    """Where this rank refused in the previous attempt: say it again, note that it is not tried again, record it for
    torchrun and the next attempt, and exit 2, at once."""
    now, path = attempt(), os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if now is None or now[0] == 1 or not re.search(r"/attempt_\d+/", path):
        return
    previous = Path(re.sub(r"/attempt_\d+/", f"/attempt_{now[0] - 2}/", path))
    try:
        before = json.loads(previous.read_text())
    except (OSError, ValueError):
        return
    if not before.get("refusal"):
        return
    lines = [line.removeprefix("error: ") for line in before["message"].splitlines()
             if not line.startswith(f"error: {_ENDED_AT_ONCE}")]
    lines.append(f"{_ENDED_AT_ONCE} {now[0]} of {now[1]} ended at once: the attempt before was refused the same "
                 "command, and no restart heals a refusal: fix what it names, then launch again")
    record_error(lines, refusal=True)
    rank_zero_first()  # a rank that ended first would have the launcher stop rank 0 before it said why
    print("\n".join(f"error: {line}" for line in lines), file=sys.stderr, flush=True)
    sys.exit(2)
