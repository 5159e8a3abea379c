"""`python -m accelerate.commands.launch ARGS` for the tests, forked from one process that imported the launcher once.

A new launcher spends seconds starting Python and importing accelerate and torch, one core busy while the other
waits: measured on 2 cores, a DDP launch of 2 MLP steps took 5.3 s as `python -m accelerate.commands.launch` and
3.4 s forked from one process that had imported it (the suite launches about 170 times). Only the launcher is forked:
it runs accelerate's own `main()` on the same arguments and environment, and its torchrun agent starts every rank as
a new `python train.py` process, as on a user's machine. Tests that signal a launcher or read its command line start
the real command (tests/test_checkpoint.py, tests/test_multinode.py, conftest.forkable), and tests/test_docs.py runs
the README's main job through the `accelerate` script itself.

The server (`python tests/helpers/forked_launch.py SOCKET`) takes one request per connection: the launcher's
arguments, environment and folder, and the two open files its output goes to. It forks a watcher that forks the
launcher, says the launcher's pid, waits for it and says its exit status; the server only accepts and forks, and
ends when the test process that started it has gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVER: tuple[subprocess.Popen, str] | None = None  # this test process's server and its socket
STARTING = threading.Lock()  # tests/test_docs.py launches from two threads


def _launch(request: dict, out: int, err: int) -> int:
    """In the forked launcher: accelerate's `main()` as `python -m accelerate.commands.launch` runs it."""
    import atexit
    import traceback

    from accelerate.commands import launch

    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [launch.__file__, *request["args"]]
    try:
        launch.main()
        code = 0
    except SystemExit as e:  # as the interpreter ends on it: an int is the status, anything else is printed
        code = e.code or 0 if e.code is None or isinstance(e.code, int) else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - an interpreter prints an uncaught exception and exits 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve(path: str) -> None:
    import accelerate.commands.launch  # noqa: F401 - the import every launch would pay; done once, before any fork

    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the watchers
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(8)
    os.rename(path + ".tmp", path)  # a client waits for the path: it appears once connections are taken
    listener.settimeout(2)
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
        while part := conn.recv(1 << 16):  # the rest of the request, to the client's end of writing
            message += part
        if os.fork() == 0:  # the watcher
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torchrun waits for its ranks
            pid = os.fork()
            if pid == 0:
                conn.close()
                os._exit(_launch(json.loads(message), *fds))
            conn.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _server() -> str:
    global SERVER
    with STARTING:
        if SERVER is None or SERVER[0].poll() is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="forked-launch-"), "socket")
            SERVER = (subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.DEVNULL), path)
        proc, path = SERVER
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"the launch server exited ({proc.returncode})")
        time.sleep(0.05)
    return path


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(64)
        if not part:
            raise RuntimeError("the launch server's watcher ended without an answer")
        data += part
    return data.decode()


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float | None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m accelerate.commands.launch ARGS`; a launch still running after
    `timeout` seconds is killed with every process under it (trainkit.compare.kill_tree) and reads as failed."""
    import psutil

    from trainkit.compare import kill_tree

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(_server())
        request = {"args": args, "cwd": str(cwd), "env": env}
        socket.send_fds(conn, [json.dumps(request).encode()], [out.fileno(), err.fileno()])
        conn.shutdown(socket.SHUT_WR)
        pid = int(_line(conn))
        conn.settimeout(timeout)
        killed = ""
        try:
            status = _line(conn)
        except TimeoutError:
            with contextlib.suppress(psutil.NoSuchProcess):
                kill_tree(psutil.Process(pid))
            conn.settimeout(None)
            status, killed = _line(conn), f"\nkilled after {timeout:.0f} s: the launch had not ended\n"
        out.seek(0)
        err.seek(0)
        return int(status), out.read(), err.read() + killed


if __name__ == "__main__":
    serve(sys.argv[1])
