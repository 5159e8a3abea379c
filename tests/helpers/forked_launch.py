"""Launches and runs of train.py for the tests, forked from one process that imported what they import, once.

A new Python process spends seconds importing accelerate, torch (with its compiler, which torch.optim loads), and for
DeepSpeed the module its ZeRO check imports, which compiles at import: measured on 2 cores, a 2-step DDP launch of
the MLP took 5.3 s as `python -m accelerate.commands.launch` and a ZeRO-2 launch 10.6 s, almost all of it imports,
the same in every one of the suite's few hundred runs. Here both the launcher and the ranks come from one server that
imported all of it before it forked anything:
- the launcher runs accelerate's own `main()` on the test's arguments, environment and folder, with one change: its
  torchrun agent starts this file's rank client (`--rank`) in place of `python -u train.py`;
- the rank client, as the process that torchrun watches, has the server fork the rank: `python -u train.py ARGS`
  in the client's folder, environment and standard streams, its own session as torchrun gives a rank. The client
  passes on the signals it gets and ends with the rank's exit status, or with the signal that ended it; if it dies,
  the rank is killed, as a launcher's death ends its ranks;
- a one-process `python train.py ARGS` runs the same way, the test process starting the client.
The server forks a rank only on the environment it imported under, but for what is read when a run starts (the
launcher's rank variables, Accelerate's and this project's settings: not_forked), and only train.py; otherwise the
client becomes `python train.py` itself. Nothing is forked where CUDA is (available()): it cannot start in a forked
process. Tests that signal a
launcher or read its command line start the real command (tests/test_checkpoint.py, tests/test_multinode.py,
tests/helpers/launching.py's forkable), and tests/test_docs.py runs the README's main job through the `accelerate`
script itself, so that a real launcher and real ranks stay tested.

The server (`python tests/helpers/forked_launch.py SOCKET`) takes one request per connection, a line of JSON with the
open files it runs on, forks a watcher that forks the launcher or the rank, says its pid, waits for it and says its
exit status; the server only accepts and forks, and ends when the test process that started it has gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
# A rank's imports beyond train.py's own, imported by the server before it forks. datasets too (half a second of
# every rank that reads text): its pyarrow's jemalloc starts a thread at import unless JE_ARROW_MALLOC_CONF, read
# then, says not to (serve), and a forked process must not have had any thread.
PRELOADED = ["torch._dynamo", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "transformers",
             "transformers.models.llama.modeling_llama", "peft", "datasets"]
ARROW_THREADS_OFF = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}  # the allocator's housekeeping thread
# What may differ between the server's environment and a forked rank's: read when a run starts, not at import.
RUN_TIME_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR",
                # set by a run itself, and so left in the tests' process by a run inside it: CPU as DeepSpeed's
                # accelerator (trainkit/launch/library_noise.py; the server's DeepSpeed found the same), the tokenizer's
                # threads off in data workers (trainkit/data/stream.py)
                "DS_ACCELERATOR", "TOKENIZERS_PARALLELISM"}
RUN_TIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "TRAINKIT_",
                     "PYTEST_")
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
SERVER: tuple[subprocess.Popen, str] | None = None  # this test process's server and its socket
SOCKET_SEEN = False  # whether SERVER's socket has appeared (a missing one is then gone, not yet to come)
STARTING = threading.Lock()  # tests/test_docs.py launches from two threads


def _exit_status(run) -> int:
    """Call run() and end as the interpreter would: SystemExit's status, a traceback and 1 for an uncaught
    exception, the threads that are not daemons waited for, the atexit handlers run, the streams flushed."""
    import atexit
    import traceback

    try:
        run()
        code = 0
    except SystemExit as e:  # an int is the status, anything else is printed
        code = e.code or 0 if e.code is None or isinstance(e.code, int) else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - an interpreter prints an uncaught exception and exits 1
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _take(request: dict, fds: list[int]) -> None:
    """The request's standard streams (its open files, in order from stdin or stdout), folder and environment."""
    first = 3 - len(fds)
    for target, fd in enumerate(fds, first):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def _launch(request: dict, fds: list[int]) -> int:
    """In the forked launcher: accelerate's `main()` as `python -m accelerate.commands.launch` runs it, with this
    file's rank client in train.py's place."""
    from accelerate.commands import launch

    _take(request, fds)
    args = request["args"]
    for i, arg in enumerate(args):
        if Path(arg).resolve() == TRAIN:
            args = [*args[:i], __file__, "--rank", request["socket"], str(TRAIN), *args[i + 1:]]
            break
    sys.argv = [launch.__file__, *args]
    return _exit_status(launch.main)


def not_forked(request: dict, preloaded_env: dict[str, str]) -> str:
    """Why a rank may not be forked from the server ("" where it may): it must be train.py itself, on an environment
    that differs from the one the server imported under only in what is read when a run starts."""
    env = request["env"]
    changed = {k for k in {*env, *preloaded_env} if env.get(k) != preloaded_env.get(k)}
    if _folders(env.get("PYTHONPATH")) == _folders(preloaded_env.get("PYTHONPATH")):
        changed.discard("PYTHONPATH")  # Accelerate's DeepSpeed launch adds the folder that is already there
    if Path(request["argv"][0]) != TRAIN:
        return f"{request['argv'][0]} is not {TRAIN}"
    return ", ".join(sorted(k for k in changed if k not in RUN_TIME_ENV and not k.startswith(RUN_TIME_PREFIXES)))


def _folders(search_path: str | None) -> list[str]:
    """The folders of a PYTHONPATH-like value, each once, in order."""
    return list(dict.fromkeys(os.path.realpath(p) for p in (search_path or "").split(os.pathsep) if p))


def _rank(request: dict, fds: list[int]) -> int:
    """In the forked rank: `python [-u] train.py ARGS` on the client's standard streams, folder and environment."""
    import runpy

    os.setsid()  # as torchrun starts a rank: a session of its own
    _take(request, fds)
    for sig in (*PASSED_ON, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = list(request["argv"])
    sys.path[0] = str(TRAIN.parent)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=request["unbuffered"])  # python -u, as torchrun starts a rank
    return _exit_status(lambda: runpy.run_path(str(TRAIN), run_name="__main__"))


def _watch(conn: socket.socket, pid: int) -> NoReturn:
    """In the watcher: say the child's pid, then its exit status; a client that goes away first (killed, or its
    test's time ran out) takes the child with it."""
    import select

    conn.sendall(f"{pid}\n".encode())
    ready, _, _ = select.select([os.pidfd_open(pid), conn], [], [])
    if conn in ready:  # the client sends nothing after its request: this is its end
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def _request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """A client's request and its open files; None where the client went away before its end of line."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while message and not message.endswith(b"\n"):
        message += (part := conn.recv(1 << 16))
        if not part:
            break
    return (json.loads(message) if message.endswith(b"\n") else None), fds


def serve(path: str) -> None:
    import runpy

    import accelerate.commands.launch  # noqa: F401 - the launcher's imports

    runpy.run_path(str(TRAIN), run_name="preloaded_train")  # a rank's: train.py's own imports, and the later ones
    before = {name: os.environ.get(name) for name in ARROW_THREADS_OFF}
    os.environ.update(ARROW_THREADS_OFF)  # for the imports only: the ranks' environment stays as it was
    for name in PRELOADED:
        with contextlib.suppress(ImportError):  # a library this machine lacks: its runs are refused, forked or not
            __import__(name)
    for name, value in before.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
    if len(os.listdir("/proc/self/task")) != 1:  # a fork copies one thread: the others' locks would stay held
        raise RuntimeError(f"the launch server may not fork: it runs threads ({threading.enumerate()})")
    preloaded_env = dict(os.environ)
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the watchers
    server = os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(8)
    os.rename(path + ".tmp", path)  # a client waits for the path: it appears once connections are taken
    listener.settimeout(2)
    try:
        while os.getppid() == parent:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            request, fds = _request(conn)
            if request is not None and "argv" in request and (why := not_forked(request, preloaded_env)):
                print(f"not forked: {shlex.join(request['argv'])}: {why}", flush=True)  # in server.log
                conn.sendall(b"decline\n")
            elif request is not None:
                sys.stdout.flush()
                sys.stderr.flush()
                if os.fork() == 0:  # the watcher
                    _forked(lambda r=request, f=fds, c=conn: _watcher(listener, c, r, f, path))
            conn.close()
            for fd in fds:
                os.close(fd)
    finally:
        if os.getpid() == server:  # never a forked child's doing: the server's socket is the suite's
            os.unlink(path)
            shutil.rmtree(os.path.dirname(path))


def _watcher(listener: socket.socket, conn: socket.socket, request: dict, fds: list[int], path: str) -> int:
    """The watcher: fork the rank (or the launcher), then say its pid and its exit status (_watch)."""
    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torchrun waits for its ranks
    pid = os.fork()
    if pid == 0:
        conn.close()
        request["socket"] = path
        _forked(lambda: _rank(request, fds) if "argv" in request else _launch(request, fds))
    _watch(conn, pid)


def _forked(work) -> NoReturn:
    """End a forked child with work()'s exit status, whatever it raises: the child never returns into the server's
    loop, whose end removes the socket every test's launch goes through (a rank that raised did so once, and every
    later launch of that test process waited for a socket that was gone)."""
    try:
        code = work()
    except BaseException:  # noqa: BLE001 - a child's end, said on its stderr
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code if isinstance(code, int) else 0)


def available() -> bool:
    """Whether runs may be forked on this machine: not where CUDA is, which a forked process cannot start, so a GPU
    machine runs the real commands."""
    import torch

    return not torch.cuda.is_available()


def server(env: dict[str, str]) -> str:
    """The socket of this test process's server, started on `env` (the tests' environment) at the first call."""
    global SERVER, SOCKET_SEEN
    with STARTING:
        if SERVER is not None and SERVER[0].poll() is None and SOCKET_SEEN and not os.path.exists(SERVER[1]):
            SERVER[0].kill()  # alive, but its socket is gone: no launch could reach it; a new server instead
            SERVER[0].wait()
        if SERVER is None or SERVER[0].poll() is not None:
            SOCKET_SEEN = False
            folder = tempfile.mkdtemp(prefix="forked-launch-")
            with open(os.path.join(folder, "server.log"), "w") as log:  # DeepSpeed's notices at import go there
                proc = subprocess.Popen([sys.executable, __file__, os.path.join(folder, "socket")], env=env,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            SERVER = (proc, os.path.join(folder, "socket"))
        proc, path = SERVER
    while not os.path.exists(path):
        if proc.poll() is not None:
            log = Path(path).with_name("server.log").read_text()[-2000:]
            raise RuntimeError(f"the launch server exited ({proc.returncode}):\n{log}")
        time.sleep(0.05)
    SOCKET_SEEN = True
    return path


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(64)
        if not part:
            raise RuntimeError("the launch server's watcher ended without an answer")
        data += part
    return data.decode()


def runner_sizes(args: list[str], cwd: Path) -> dict[str, str]:
    """A forked launch's ranks have the server's command line above them, not `accelerate launch --config_file`'s:
    the sizes a rank reads from its launcher's YAML where its environment does not name them (RUNNER_SIZES: the
    experts' ep; trainkit/launch/launcher.py's launcher_sizes) are given in the environment instead, with the YAML's
    values (the caller's environment still wins, as the rank's own would). tests/test_forked_launch.py shows the run
    the same as the real one."""
    import yaml

    from trainkit.launch.launcher import PARALLELISM_KEY, RUNNER_SIZES

    if "--config_file" not in args:
        return {}
    sizes = yaml.safe_load((Path(cwd) / args[args.index("--config_file") + 1]).read_text()).get(
        "parallelism_config") or {}
    return {var: str(sizes[PARALLELISM_KEY.format(name)]) for name, var in RUNNER_SIZES.items()
            if PARALLELISM_KEY.format(name) in sizes}


def launch(args: list[str], cwd: Path, env: dict[str, str], timeout: float | None,
           server_env: dict[str, str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m accelerate.commands.launch ARGS`; a launch still going after
    `timeout` seconds is killed with every process under it (trainkit.launch.train_process.kill_tree) and reads as
    failed."""
    import psutil

    from trainkit.launch.train_process import kill_tree

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(server(server_env))
        request = {"args": args, "cwd": str(cwd), "env": {**runner_sizes(args, cwd), **env}}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [out.fileno(), err.fileno()])
        pid = int(_line(conn))
        conn.settimeout(timeout)
        killed = ""
        try:
            status = _line(conn)
        except TimeoutError:
            with contextlib.suppress(psutil.NoSuchProcess):
                kill_tree(psutil.Process(pid))
            conn.settimeout(None)
            status, killed = _line(conn), killed_after(timeout)
        out.seek(0)
        err.seek(0)
        return int(status), out.read(), err.read() + killed


def train(args: list[str], cwd: Path, env: dict[str, str], timeout: float | None,
          server_env: dict[str, str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python train.py ARGS`, as launch() for the rest."""
    from trainkit.launch.train_process import kill_tree

    with subprocess.Popen([sys.executable, __file__, "--rank", server(server_env), str(TRAIN), *args], cwd=cwd,
                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)  # the client: its watcher then kills the rank
            out, err = proc.communicate()
            err += killed_after(timeout)
    return proc.returncode, out, err


def killed_after(timeout: float | None) -> str:
    """What a run killed for its time says (the words of trainkit.launch.train_process.run_config)."""
    return f"\nkilled after {timeout:.0f} s: the launch had not ended\n"


def rank_client(path: str, script: str, args: list[str]) -> NoReturn:
    """What runs in place of `python [-u] train.py ARGS`: the rank forked from the server on this process's standard
    streams, folder and environment, its signals passed on and its exit status taken as this process's own; where
    the server declines (not_forked), this process becomes `python [-u] train.py ARGS`."""
    unbuffered = sys.stdout.write_through  # python -u, as torchrun starts its workers
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {"argv": [script, *args], "cwd": os.getcwd(), "env": dict(os.environ), "unbuffered": unbuffered}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    answer = _line(conn)
    if answer == "decline\n":
        os.execv(sys.executable, [sys.executable, *(["-u"] if unbuffered else []), script, *args])
    pid = int(answer)
    for sig in PASSED_ON:
        signal.signal(sig, lambda sig, _: os.kill(pid, sig))
    status = int(_line(conn))
    if status < 0:  # ended by a signal: so does this process, as its launcher would see a rank end
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_client(sys.argv[2], sys.argv[3], sys.argv[4:])
    serve(sys.argv[1])
