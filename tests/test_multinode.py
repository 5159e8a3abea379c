"""Several machines, for real, on one: the per-machine launch (multinode.yaml, and the SLURM example that drives it),
DeepSpeed's hostfile launcher over a real OpenSSH server on loopback, a machine that dies or falls silent mid-run,
and the hostfile pre-flight of --dry_run.

Two "machines" here are two launches on 127.0.0.1 (torchrun style) or the two loopback hosts 127.0.0.1 and 127.0.0.2
(hostfile style); each runs one process, and together they must train exactly like one ddp.yaml launch of 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.cpp_extension import get_default_build_root

from conftest import LAUNCH_TIMEOUT, RESTARTED, ROOT, TEST_ENV, Run, kill_tree, launch, max_rel_diff
from trainkit.launch.hostfile import check_hosts
from trainkit.launch.launcher import Launch

MLP = ["--recipe", "mlp", "--max_steps", "15", "--eval_every", "0", "--batch_size", "8"]
ENV = {**os.environ, **TEST_ENV}
ENV.pop("TRAINKIT_DIST_TIMEOUT", None)
HOSTS = ("127.0.0.1", "127.0.0.2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_on_both_hosts() -> int:
    """A port nothing listens on at either loopback host (the test sshd's: a fixed one met a server still stopping,
    or another run's)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            if s.connect_ex((HOSTS[1], port)) != 0:
                return port


class Machine:
    """One machine's `accelerate launch --config_file multinode.yaml --machine_rank R ...`, running in background."""

    def __init__(self, rank: int, port: int, output_dir: Path, args: list[str], env: dict | None = None,
                 launch_args: tuple[str, ...] = (), logs: str = ""):
        self.output_dir = output_dir
        self.logs = output_dir.parent / (logs or f"machine{rank}")
        self.logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", str(ROOT / "accelerate_configs" / "multinode.yaml"),
               "--num_machines", "2", "--machine_rank", str(rank),
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *launch_args,
               "train.py", "--output_dir", str(output_dir), "--report_to", "none", *args]
        with open(self.logs / "stdout", "w") as out, open(self.logs / "stderr", "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=out, stderr=err)

    def wait(self, timeout: float) -> Run:
        self.proc.wait(timeout=timeout)
        return Run(f"machine {self.logs.name}", self.proc.returncode, (self.logs / "stdout").read_text(),
                   (self.logs / "stderr").read_text(), self.output_dir)

    def steps_done(self) -> int:
        path = self.output_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0


def two_machines(tmp_path: Path, args: list[str], env: dict | None = None,
                 shared: bool = True) -> tuple[Machine, Machine]:
    """Machine ranks 0 and 1, one process each, rendezvous on 127.0.0.1; one output folder that both see, as on a
    cluster's shared file system, or (shared=False) each its own, as machines without one would have."""
    port = free_port()
    return (Machine(0, port, tmp_path / "out0", args, env),
            Machine(1, port, tmp_path / ("out0" if shared else "out1"), args, env))


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """One ddp.yaml launch of 2 processes on one machine: what two machines of one process each must reproduce."""
    run = launch(tmp_path_factory.mktemp("ddp") / "out", *MLP, config="ddp").check()
    assert run.resolved["world_size"] == 2 and run.resolved["num_machines"] == 1
    assert run.losses[-1] < 0.85 * run.losses[0]  # a real training curve (11.6 -> 8.8 in 15 steps)
    return run


# --- torchrun style: one launch per machine ------------------------------------------------------------------------

@pytest.mark.slow
def test_two_machine_launches_match_one_ddp_launch(ddp_reference, tmp_path):
    machines = two_machines(tmp_path, MLP)
    try:
        first, second = (m.wait(timeout=100) for m in machines)
    finally:
        for m in machines:
            kill_tree(m.proc)
    first.check()
    second.check()
    assert first.resolved["num_machines"] == 2 and first.resolved["world_size"] == 2
    assert first.resolved["strategy"] == "ddp" and first.resolved["global_batch_size"] == 16
    assert len(first.losses) == 15
    diff = max_rel_diff(first.losses, ddp_reference.losses)
    print(f"\nmultinode.yaml, 2 machines x 1 process vs ddp.yaml 2 processes: max relative loss difference {diff:.2e}")
    assert diff <= 1e-5
    # only rank 0 (machine 0) writes what the ranks share: one line per step, not two
    assert (first.output_dir / "final").is_dir()
    assert len((first.output_dir / "metrics.jsonl").read_text().splitlines()) == 15


@pytest.mark.slow
def test_machines_that_do_not_share_the_output_folder_are_refused_at_start(tmp_path):
    """Each machine launched with the same relative-looking --output_dir on its own disk: refused before the first
    step, by every rank alike, naming who cannot see the folder and the fix, not at the first save as a full disk."""
    machines = two_machines(tmp_path, [*MLP, "--save_every", "5"], shared=False)
    try:
        first, second = (m.wait(timeout=100) for m in machines)
    finally:
        for m in machines:
            kill_tree(m.proc)
    for run in (first, second):
        assert run.returncode != 0, run.stderr[-2000:]
        assert re.search(r"error: rank 1 on \S+ cannot see \S+ as rank 0 on \S+ writes it .*\(--output_dir\): "
                         r"pass an --output_dir on a file system that every machine mounts at the same path",
                         run.stderr), run.stderr[-3000:]
    assert not (tmp_path / "out0" / "metrics.jsonl").exists() and not (tmp_path / "out1" / "checkpoints").exists()


def start_long_run(tmp_path: Path, env: dict | None = None) -> tuple[Machine, Machine]:
    """Two machines on a run far too long to finish, once machine 0 has logged a few steps."""
    machines = two_machines(tmp_path, [*MLP[:2], "--max_steps", "1000000", "--eval_every", "0", "--batch_size", "8"],
                            env)
    deadline = time.monotonic() + 90
    while machines[0].steps_done() < 3:
        if time.monotonic() > deadline or any(m.proc.poll() is not None for m in machines):
            for m in machines:
                kill_tree(m.proc)
            logs = "\n".join((m.logs / "stderr").read_text()[-2000:] for m in machines)
            pytest.fail(f"the two machines did not start training within 90 s:\n{logs}")
        time.sleep(0.2)
    return machines


def wait_for_exit(machine: Machine, limit: float) -> tuple[Run, float]:
    started = time.monotonic()
    try:
        run = machine.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_tree(machine.proc)
        pytest.fail(f"machine 0 was still running {limit:.0f} s after machine 1 went away: it would hang")
    return run, time.monotonic() - started


@pytest.mark.slow
def test_a_dead_machine_stops_the_other(tmp_path):
    """Machine 1 is killed (its launcher and worker); machine 0 must fail at once, not wait for a timeout."""
    first, second = start_long_run(tmp_path)
    try:
        kill_tree(second.proc)
        run, elapsed = wait_for_exit(first, limit=60)
    finally:
        kill_tree(first.proc)
        kill_tree(second.proc)
    print(f"\nmachine 1 killed: machine 0 exited {run.returncode} after {elapsed:.1f} s")
    assert run.returncode != 0
    # gloo sees the closed connection in a read or a write, whichever comes first
    assert re.search(r"error: rank 0 lost contact with the other processes \((Read error )?(\[[\d.:]+\]:\d+: )?"
                     r"Connection (closed|reset) by peer", run.stderr), run.stderr[-3000:]
    assert re.search(r"; rank 1 on \S+ \(machine 1\), pid \d+ did not answer", run.stderr), run.stderr[-3000:]
    assert "ChildFailedError" in run.stderr  # torchrun on machine 0 reports its worker's failure and exits
    assert 1 <= first.steps_done() < 1000000


@pytest.mark.slow
def test_a_launcher_killed_alone_takes_its_ranks_and_the_other_machine_stops(tmp_path):
    """SIGKILL to machine 1's `accelerate launch` only (torchrun started its rank in a session of its own, out of
    the launcher's reach): the rank ends with its launcher (trainkit/launch/rank_exit.py, end_with_launcher), and
    machine 0
    loses contact and fails within seconds instead of training beside an orphan and waiting at the exit barrier."""
    import psutil

    first, second = start_long_run(tmp_path)
    try:
        ranks = [p for p in psutil.Process(second.proc.pid).children(recursive=True) if "train.py" in p.cmdline()]
        assert len(ranks) == 1
        second.proc.kill()
        second.proc.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        run, elapsed = wait_for_exit(first, limit=60)
    finally:
        kill_tree(first.proc)
        for p in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    print(f"\nmachine 1's launcher killed: its rank ended; machine 0 exited {run.returncode} after {elapsed:.1f} s")
    assert not alive, alive  # the rank is gone too, within seconds of its launcher
    assert run.returncode != 0 and elapsed < 60
    assert re.search(r"error: rank 0 lost contact with the other processes", run.stderr), run.stderr[-3000:]


@pytest.mark.slow
def test_a_silent_machine_stops_the_other_within_the_timeout(tmp_path):
    """Machine 1 stops answering without closing its connections (SIGSTOP: a frozen host, a cut cable). Machine 0
    must fail once TRAINKIT_DIST_TIMEOUT has passed, not wait forever (torch's own default: 30 min over gloo)."""
    timeout = 10
    first, second = start_long_run(tmp_path, env={"TRAINKIT_DIST_TIMEOUT": str(timeout)})
    try:
        kill_tree(second.proc, signal.SIGSTOP)
        run, elapsed = wait_for_exit(first, limit=timeout + 50)
    finally:
        kill_tree(first.proc)
        kill_tree(second.proc)  # SIGKILL ends stopped processes too
    print(f"\nmachine 1 stopped: machine 0 exited {run.returncode} after {elapsed:.1f} s (timeout {timeout} s)")
    assert run.returncode != 0
    assert f"error: rank 0 lost contact with the other processes (Timed out waiting {timeout * 1000}ms" in run.stderr, \
        run.stderr[-3000:]
    # named by the roll call in the store machine 0 holds (trainkit/launch/rank_exit.py)
    assert re.search(rf"; rank 1 on {socket.gethostname()} \(machine 1\), pid \d+ did not answer within 3 s "
                     r"\(dead, frozen or cut off\)", run.stderr), run.stderr[-3000:]
    assert elapsed >= timeout * 0.5  # it was the timeout that ended it (the run may have been mid-collective)


@pytest.mark.slow
def test_a_killed_machine_started_again_rejoins_and_the_run_continues_exactly(never_restarted, tmp_path):
    """Machine 1 (its launcher and its rank) SIGKILLed at a random step between two checkpoints, and its launch
    started again as a scheduler would, while machine 0's torchrun (--max_restarts) starts its own rank again: both
    join the attempt counted in the store machine 0 holds (join_restarted_group, trainkit/strategies/accelerator.py;
    each machine's own restart count differs), and the run continues from the newest checkpoint with the curve of a
    run never stopped, bit for bit, each step once in metrics.jsonl."""
    import random

    port, out, save_every = free_port(), tmp_path / "out", 200
    args, launch_args = [*RESTARTED, "--resume", "auto"], ("--max_restarts", "2")
    first, second = (Machine(rank, port, out, args, launch_args=launch_args) for rank in (0, 1))
    kill_at, again = random.randint(save_every + 10, 2 * save_every - 40), None
    try:
        deadline = time.monotonic() + 120
        while first.steps_done() < kill_at and first.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = first.steps_done()
        kill_tree(second.proc)
        killed_at = time.monotonic()
        again = Machine(1, port, out, args, launch_args=launch_args, logs="machine1_again")
        runs = [m.wait(timeout=LAUNCH_TIMEOUT) for m in (first, again)]
    finally:
        for m in (first, second, again):
            if m is not None:
                kill_tree(m.proc)
    print(f"\nmachine 1 killed at step {killed} and started again: the run ended {time.monotonic() - killed_at:.1f} s "
          "later")
    for run in runs:
        run.check()
    assert save_every < killed < 2 * save_every, runs[0].stderr[-3000:]
    assert re.search(r"error: rank 0 lost contact with the other processes .*; rank 1 on \S+ \(machine 1\)",
                     runs[0].stderr), runs[0].stderr[-3000:]
    assert "note: attempt 2 of this launch (a rank was started again): the ranks joined anew" in runs[0].stderr
    assert f"note: --resume auto: continuing from {out / 'checkpoints' / f'step_{save_every}'}" in runs[0].stderr
    assert "connectFullMesh failed" not in runs[1].stderr  # machine 1 came back into the attempt, not the dead one
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [m["step"] for m in never_restarted.metrics]
    assert [m["loss"] for m in metrics] == never_restarted.losses


# --- SLURM: the example script, with srun and scontrol played by two local "nodes" --------------------------------

FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: run the command once per node of the allocation, with that node's SLURM_NODEID, all at once.
while [[ $1 == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol stand-in: `scontrol show hostnames LIST` prints one host per node; `scontrol requeue ID` is recorded.
if [[ $1 == requeue ]]; then echo "requeue $2" >> "$SCONTROL_LOG"; exit 0; fi
for ((node = 0; node < SLURM_NNODES; node++)); do echo 127.0.0.1; done
"""


def slurm_job(tmp_path: Path) -> dict[str, str]:
    """The environment of a 2-node SLURM job whose srun and scontrol are the stand-ins above."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**ENV, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "1",
            "GPUS_PER_NODE": "1", "MAIN_PORT": str(free_port()), "SCONTROL_LOG": str(tmp_path / "scontrol.log")}


@pytest.mark.slow
def test_slurm_example_requeues_itself_after_a_preemption_and_continues(tmp_path):
    """SLURM's --signal=TERM sends SIGTERM to the job's launchers: every rank stops with a checkpoint, the launchers
    exit 1 (torchrun), the script reads stopped.json, requeues the job and exits 0; the requeued job (the same
    script and arguments) continues from the checkpoint (--resume auto, which the script adds) to the end."""
    import psutil

    env, out = slurm_job(tmp_path), tmp_path / "out"
    args = ["--recipe", "mlp", "--max_steps", "600", "--eval_every", "0", "--batch_size", "8", "--output_dir",
            str(out), "--report_to", "none"]
    log = tmp_path / "job1.log"
    job = subprocess.Popen(["bash", str(ROOT / "examples" / "slurm.sbatch"), *args], cwd=ROOT, env=env,
                           stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 20:
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        launchers = [p for p in psutil.Process(job.pid).children(recursive=True)
                     if "launch" in p.cmdline() and "train.py" in p.cmdline()]
        assert len(launchers) == 2, [p.cmdline() for p in launchers]
        for launcher in launchers:
            launcher.send_signal(signal.SIGTERM)
        job.wait(timeout=120)
    finally:
        kill_tree(job)
    first = log.read_text()
    stopped = json.loads((out / "stopped.json").read_text())
    assert job.returncode == 0 and "requeueing job 4242" in first, first[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert stopped["stopped_by"] == "SIGTERM" and 20 <= stopped["step"] < 600
    # requeued onto 3 nodes: the pre-flight checks that world (3 x GPUS_PER_NODE), whose global batch is not the
    # checkpoint's, and refuses before srun starts anything
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    resized = subprocess.run(["bash", str(ROOT / "examples" / "slurm.sbatch"), *args], cwd=ROOT,
                             env={**env, "SLURM_NNODES": "3"}, capture_output=True, text=True, timeout=120)
    assert resized.returncode == 2, resized.stderr[-3000:]
    assert "global_batch_size is 24 but the checkpoint was trained with 16" in resized.stderr
    assert "waiting for" not in resized.stderr and {p: p.stat().st_mtime_ns for p in out.rglob("*")
                                                    if p.is_file()} == before
    requeued = subprocess.run(["bash", str(ROOT / "examples" / "slurm.sbatch"), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"continuing from {out / 'checkpoints' / ('step_' + str(stopped['step']))}" in requeued.stderr
    assert [m["step"] for m in Run("slurm", 0, "", "", out).metrics] == list(range(1, 601))
    assert not (out / "stopped.json").exists() and (out / "final").is_dir()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # a finished job is not requeued


@pytest.mark.slow
def test_slurm_example_starts_one_launch_per_node(ddp_reference, tmp_path):
    env = slurm_job(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "examples" / "slurm.sbatch"), *MLP, "--output_dir", str(out),
                           "--report_to", "none"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    run = Run("slurm", proc.returncode, proc.stdout, proc.stderr, out).check()
    assert run.resolved["num_machines"] == 2 and run.resolved["world_size"] == 2
    assert max_rel_diff(run.losses, ddp_reference.losses) <= 1e-5


# --- DeepSpeed's hostfile launcher over real ssh -------------------------------------------------------------------

def _sshd_binary() -> str | None:
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/sbin/sshd") if os.access(p, os.X_OK)), None)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A throw-away OpenSSH server on 127.0.0.1 and 127.0.0.2, on a port free on both, accepting a key made here.

    Clients use the ssh_config written here (`ssh -F`, which replaces ~/.ssh/config and /etc/ssh/ssh_config):
    nothing in ~/.ssh is read or written. The server stops (by its pid file) when the module's tests are done.
    """
    tools = {"sshd (openssh-server)": _sshd_binary(), "ssh (openssh-client)": shutil.which("ssh"),
             "ssh-keygen": shutil.which("ssh-keygen"), "pdsh": shutil.which("pdsh")}
    missing = [name for name, path in tools.items() if not path]
    if missing:
        pytest.skip(f"cannot run DeepSpeed's launcher over real ssh: {', '.join(missing)} not installed "
                    f"(Debian: apt-get install openssh-server pdsh; .ci/run does)")
    port = free_on_both_hosts()
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "trainkit-test", "-f", str(d / key)],
                       check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    (d / "sshd_config").write_text(f"""\
Port {port}
ListenAddress {HOSTS[0]}
ListenAddress {HOSTS[1]}
HostKey {d / 'host_key'}
AuthorizedKeysFile {d / 'authorized_keys'}
PidFile {d / 'sshd.pid'}
UsePAM no
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
X11Forwarding no
PrintMotd no
UseDNS no
MaxStartups 64
LogLevel VERBOSE
""")
    (d / "ssh_config").write_text(f"""\
Host *
  Port {port}
  IdentityFile {d / 'client_key'}
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /dev/null
  LogLevel ERROR
""")
    try:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    except OSError:
        pass  # not root: sshd says below whether it can do without
    started = subprocess.run([_sshd_binary(), "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")],
                             capture_output=True, text=True)
    log = d / "sshd.log"
    if started.returncode != 0:
        pytest.skip(f"sshd could not start: {started.stderr.strip()} {log.read_text().strip() if log.exists() else ''}")
    pid_file = d / "sshd.pid"
    deadline = time.monotonic() + 10
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    server = SimpleNamespace(dir=d, config=d / "ssh_config", log=log, pid_file=pid_file, port=port)
    try:
        for host in HOSTS:
            login = subprocess.run(["ssh", "-F", str(server.config), "-o", "BatchMode=yes", host, "true"],
                                   capture_output=True, text=True, timeout=30)
            assert login.returncode == 0, f"key login to {host}:{port} failed: {login.stderr}\n{log.read_text()}"
        yield server
    finally:
        if pid_file.exists():
            pid = int(pid_file.read_text())
            try:
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.05)
            except ProcessLookupError:
                pass


def write_hostfile(path: Path, *lines: str) -> Path:
    path.write_text("# two loopback 'machines', one slot each\n" + "".join(f"{line}\n" for line in lines))
    return path


def assert_both_hosts_reached(server, since: int) -> None:
    """sshd's log shows a session on each loopback host: both ranks really came through ssh."""
    log = server.log.read_text()[since:]
    for host in HOSTS:
        assert f"on {host} port {server.port}" in log, log[-3000:]


def ssh_env(sshd, tmp_path: Path) -> dict[str, str]:
    """The environment of a hostfile launch that reaches the loopback sshd: pdsh's ssh gets `-F <our ssh_config>`
    through PDSH_SSH_ARGS_APPEND, and an `ssh` first on PATH adds it for DeepSpeed's own ssh check, which ignores
    that variable (the user's ~/.ssh/config with a Port line, as the YAML's header says)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {sshd.config} "$@"\n')
    (bin_dir / "ssh").chmod(0o755)
    return {**ENV, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PDSH_SSH_ARGS_APPEND": f"-F {sshd.config}"}


def start_hosts_launch(sshd, tmp_path: Path, args: list[str], launch_args: tuple[str, ...] = (),
                       env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """`python -m trainkit.launch.hostfile` of deepspeed_hostfile.yaml on the two loopback hosts, one rank each, in a
    session of its own (a scheduler signals its process group), its output in one pipe; and the run's output folder.
    `env`: the launch's environment (ssh_env's unless given)."""
    hostfile = write_hostfile(tmp_path / "hostfile", f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "trainkit.launch.hostfile",
           "--config_file", str(ROOT / "accelerate_configs" / "deepspeed_hostfile.yaml"), *launch_args,
           "--deepspeed_hostfile", str(hostfile), "--main_process_ip", HOSTS[0],
           "--main_process_port", str(free_port()), "train.py", "--output_dir", str(out), "--report_to", "none",
           *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or ssh_env(sshd, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True), out


def check_deepspeed_run(run: Run, reference: Run) -> float:
    run.check()
    assert run.resolved["strategy"] == "deepspeed" and run.resolved["zero_stage"] == 2
    assert run.resolved["world_size"] == 2 and run.resolved["num_machines"] == 2
    assert len(run.losses) == 15
    diff = max_rel_diff(run.losses, reference.losses)
    assert diff <= 1e-5
    return diff


@pytest.mark.slow
def test_hostfile_yaml_over_ssh_matches_ddp(sshd, ddp_reference, tmp_path):
    """accelerate launch --config_file deepspeed_hostfile.yaml: one command starts both ranks through pdsh and ssh.

    Accelerate cannot pass DeepSpeed's --ssh_port or --no_ssh_check, and DeepSpeed's own ssh check ignores
    PDSH_SSH_ARGS_APPEND: an `ssh` first on PATH that adds `-F <our ssh_config>` stands in for the user's
    ~/.ssh/config with a Port line (the YAML's header says so). Launched by habit from a folder of this test (the
    YAML's ds_configs/ linked there), with a fake token in the shell: Accelerate dumps the shell into
    ./.deepspeed_env there and DeepSpeed's runner exports it on every host; the ranks say so loudly, naming the
    variable, not its value, and remove that file.
    """
    hostfile = write_hostfile(tmp_path / "hostfile", f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1")
    here = tmp_path / "launch_folder"
    here.mkdir()
    (here / "ds_configs").symlink_to(ROOT / "ds_configs")
    token = "hf_fake_secret_123"
    env = {**ssh_env(sshd, tmp_path), "HF_TOKEN": token}
    env.pop("DS_ENV_FILE", None)
    out = tmp_path / "out"
    log_start = len(sshd.log.read_text())
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(ROOT / "accelerate_configs" / "deepspeed_hostfile.yaml"),
           "--deepspeed_hostfile", str(hostfile), "--main_process_ip", HOSTS[0],
           "--main_process_port", str(free_port()), str(ROOT / "train.py"), "--output_dir", str(out), "--report_to",
           "none", *MLP]
    proc = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=110)
    run = Run("deepspeed_hostfile.yaml", proc.returncode, proc.stdout, proc.stderr, out)
    diff = check_deepspeed_run(run, ddp_reference)
    print(f"\ndeepspeed_hostfile.yaml over ssh (2 hosts x 1) vs ddp.yaml: max relative loss difference {diff:.2e}")
    assert_both_hosts_reached(sshd, log_start)
    assert "warning: this hostfile launch did not come through `python -m trainkit.launch.hostfile`, so the " \
           "launching shell's HF_TOKEN went to every host" in run.stderr, run.stderr[-3000:]
    assert f"in {here / '.deepspeed_env'} (mode 644; removed now)" in run.stderr \
        and "python -m trainkit.launch.hostfile --config_file" in run.stderr
    assert not (here / ".deepspeed_env").exists() and run.stderr.count("warning: this hostfile launch") == 1


def test_hosts_launcher_names_a_leftover_env_file(tmp_path, monkeypatch, capsys):
    """A ./.deepspeed_env left by an earlier habit launch holds secrets in plain text: trainkit.launch.hostfile says
    so."""
    from trainkit.launch import hostfile

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("PATH=/usr/bin\nWANDB_API_KEY=abc123\n")
    started = []
    monkeypatch.setattr(hostfile, "launch_passing_signals", lambda cmd, env, argv: started.append(env) or 0)
    assert hostfile.main(["--config_file", "cluster.yaml", "train.py"]) == 0
    err = capsys.readouterr().err
    assert f"note: {tmp_path / '.deepspeed_env'} is left from an earlier `accelerate launch` of a hostfile YAML and " \
           f"holds WANDB_API_KEY in plain text" in err and "abc123" not in err
    assert started[0][hostfile.HOSTS_LAUNCH] == "1"  # what tells the ranks the launch came through it


@pytest.mark.slow
def test_hosts_launcher_stopped_by_a_scheduler_over_ssh_exits_0_with_the_stop_recorded(sshd, tmp_path):
    """SIGTERM to `python -m trainkit.launch.hostfile`'s process group, as a scheduler sends it, over real ssh:
    DeepSpeed's pdsh runner closes the hosts' ssh sessions a second after passing the signal on, and each host's
    launcher then stops its ranks. The ranks outlive their closed sessions (trainkit/launch/rank_exit.py,
    outlive_its_terminal: before, the next print ended them mid-checkpoint, exit 241, nothing recorded), stop at one
    step with a checkpoint, record it, and
    trainkit.launch.hostfile exits 0; its private env file is removed after the launch, not before."""
    proc, out = start_hosts_launch(sshd, tmp_path, [*MLP[:2], "--max_steps", "100000", "--eval_every", "0",
                                                    "--batch_size", "8"])
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and (
                len(metrics.read_text().splitlines()) if metrics.exists() else 0) < 3:
            time.sleep(0.1)
        private = list(Path(tempfile.gettempdir()).glob("trainkit-hosts-*"))
        os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, output[-3000:]
    stopped = json.loads((out / "stopped.json").read_text())
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert stopped["stopped_by"] == "SIGTERM" and latest == f"step_{stopped['step']}", (stopped, latest)
    assert (out / "checkpoints" / latest / "trainer_state.json").is_file()
    assert len(metrics.read_text().splitlines()) == stopped["step"] < 100000
    assert "the launch stopped on SIGTERM with a checkpoint" in output
    assert len(private) == 1 and not private[0].exists(), output[-3000:]  # removed after the launch, not before


# One launch of `python -m trainkit.launch.hostfile` serves the two tests below: a restart over real ssh, with
# secrets planted in the shell that neither attempt may send.
SECRETS = {"HF_TOKEN": "hf_fake_secret_123", "MY_API_KEY": "key_fake_456"}


@pytest.fixture(scope="module")
def hosts_restarted(sshd, tmp_path_factory):
    """`python -m trainkit.launch.hostfile --max_restarts 1 ... --resume auto` over real ssh (DeepSpeed's pdsh
    launcher, which has no restarts of its own), with a fake token and key in the shell and a ~/.deepspeed_env of the
    test's: one host's rank SIGKILLed between two checkpoints, the other loses contact, the launch fails and
    trainkit.launch.hostfile starts it again. Its output, output folder, the step of the kill, the ssh command lines
    both attempts sent, the repository's .deepspeed_env before it, and a DDP launch of the same run."""
    import psutil

    tmp_path = tmp_path_factory.mktemp("hosts_restarted")
    steps, save_every = 120, 40
    args = ["--recipe", "mlp", "--max_steps", str(steps), "--eval_every", "0", "--batch_size", "4", "--save_every",
            str(save_every)]
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    (home / ".deepspeed_env").write_text("TRAINKIT_MARK=from_home\n")
    ssh_args = tmp_path / "ssh_args"
    (bin_dir / "ssh").write_text(f'#!/bin/sh\necho "$@" >> {ssh_args}\n'
                                 f'exec {shutil.which("ssh")} -F {sshd.config} "$@"\n')
    (bin_dir / "ssh").chmod(0o755)
    # HOME is the test's (its ~/.deepspeed_env); DeepSpeed's compiled ops stay where they are (else ~30 s to rebuild)
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(get_default_build_root()) / (
        f"py{sys.version_info[0]}{sys.version_info[1]}_"
        + (f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")))
    env = {**ENV, "HOME": str(home), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PDSH_SSH_ARGS_APPEND": f"-F {sshd.config}", **SECRETS, "TORCH_EXTENSIONS_DIR": extensions}
    env.pop("DS_ENV_FILE", None)
    before = (ROOT / ".deepspeed_env").read_text() if (ROOT / ".deepspeed_env").exists() else None
    proc, out = start_hosts_launch(sshd, tmp_path, [*args, "--resume", "auto"], ("--max_restarts", "1"), env)
    metrics, killed = out / "metrics.jsonl", None
    try:
        deadline = time.time() + 120
        while killed is None and time.time() < deadline and proc.poll() is None:
            if (len(metrics.read_text().splitlines()) if metrics.exists() else 0) >= save_every + 5:
                ranks = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])
                         and "train.py" in p.info["cmdline"] and "trainkit.launch.hostfile" not in p.info["cmdline"]]
                killed = len(metrics.read_text().splitlines())
                max(ranks, key=lambda p: p.pid).kill()
            time.sleep(0.01)
        output = proc.communicate(timeout=LAUNCH_TIMEOUT)[0]
    finally:
        kill_tree(proc)
    reference = launch(tmp_path / "ddp", *args, config="ddp").check()
    return SimpleNamespace(returncode=proc.returncode, output=output, out=out, killed=killed, steps=steps,
                           save_every=save_every, sent=ssh_args.read_text(), tmp_path=tmp_path,
                           deepspeed_env_before=before, reference=reference)


@pytest.mark.slow
def test_hosts_launcher_restarts_a_launch_that_lost_a_rank(hosts_restarted):
    """The run (hosts_restarted) continues from the newest checkpoint and ends with each step once and the curve of
    one uninterrupted DDP launch (ZeRO-2 against DDP: within 1e-5)."""
    run, save_every = hosts_restarted, hosts_restarted.save_every
    assert run.returncode == 0 and run.killed is not None and run.killed < 2 * save_every, run.output[-3000:]
    assert "note: the launch failed (exit 1); starting it again (1 of --max_restarts 1)" in run.output, \
        run.output[-3000:]
    assert f"note: --resume auto: continuing from {run.out / 'checkpoints' / f'step_{save_every}'}" in run.output
    lines = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, run.steps + 1))
    assert max_rel_diff([m["loss"] for m in lines], run.reference.losses) <= 1e-5


@pytest.mark.slow
def test_hosts_launcher_sends_the_hosts_no_secret(hosts_restarted):
    """The fake token and key planted in the shell (hosts_restarted) reach no file and no host's command line in
    either attempt (accelerate launch alone wrote the shell's 47 lines into ./.deepspeed_env and onto every pdsh
    command line); what ~/.deepspeed_env lists still travels; the private env file is gone after."""
    run = hosts_restarted
    assert run.returncode == 0, run.output[-3000:]
    assert "not sent to the hosts, among them HF_TOKEN, MY_API_KEY" in run.output, run.output[-3000:]
    assert run.sent.count("export TRAINKIT_MARK=from_home") == 4  # 2 hosts x 2 attempts
    assert "export ACCELERATE_USE_DEEPSPEED=true" in run.sent
    assert not [secret for secret in SECRETS.values() if secret in run.sent]
    written = [p for p in run.tmp_path.rglob("*") if p.is_file()] + [ROOT / ".deepspeed_env"] * (
        run.deepspeed_env_before is not None)
    assert not [file for file in written if any(s in file.read_text(errors="ignore") for s in SECRETS.values())]
    assert ((ROOT / ".deepspeed_env").read_text() if (ROOT / ".deepspeed_env").exists() else None) \
        == run.deepspeed_env_before
    assert not list(Path(tempfile.gettempdir()).glob("trainkit-hosts-*"))


# The launcher DeepSpeed's runner stands for: on SIGTERM it has the ranks save and record the stop, then ends.
RUNNER = """import json, signal, sys, time
def stop(signum, frame):
    time.sleep(0.5)  # the ranks' checkpoint
    open(sys.argv[1], "w").write(json.dumps({"stopped_by": "SIGTERM"}))
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".started", "w").close()
time.sleep(60)
"""


def test_hosts_launcher_passes_a_schedulers_sigterm_on_to_the_launchers_and_exits_0_on_a_recorded_stop(tmp_path):
    """trainkit.launch.hostfile gets SIGTERM (a scheduler's preemption): it passes it on to `accelerate launch` (here a
    stand-in that, like it, has no handler and ends at once) and to the launcher that one started (DeepSpeed's runner,
    here a stand-in that records the stop as the ranks do), waits for the record, and exits 0; before, the signal ended
    trainkit.launch.hostfile at once, leaving the launch and its private env file behind. The same over real ssh is the
    test
    above."""
    import threading

    from trainkit.launch.hostfile import launch_passing_signals

    record = tmp_path / "out" / "stopped.json"
    record.parent.mkdir()
    runner = [sys.executable, "-c", RUNNER, str(record)]
    accelerate = f"import subprocess, sys; sys.exit(subprocess.call({runner!r}))"
    argv = ["--config_file", "cluster.yaml", "train.py", "--recipe", "mlp", "--output_dir", str(record.parent)]

    def preempt() -> None:
        while not record.with_name("stopped.json.started").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()
    started, handler = time.time(), signal.getsignal(signal.SIGTERM)
    assert launch_passing_signals([sys.executable, "-c", accelerate], dict(os.environ), argv) == 0
    assert json.loads(record.read_text()) == {"stopped_by": "SIGTERM"} and time.time() - started < 20
    assert signal.getsignal(signal.SIGTERM) == handler  # this process's own handling back


def test_dry_run_of_a_hostfile_launch_warns_of_secrets_in_the_shell(check_only, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fake_secret_123")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a setting, not a secret (datasets' map sets it)
    yaml_file = tmp_path / "cluster.yaml"
    yaml_file.write_text((ROOT / "accelerate_configs" / "deepspeed_hostfile.yaml").read_text()
                         .replace("deepspeed_hostfile: hostfile", f"deepspeed_hostfile: {tmp_path / 'missing'}"))
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config", str(yaml_file))
    assert "note: this shell holds HF_TOKEN: `accelerate launch` with" in run.stderr
    assert "launch with `python -m trainkit.launch.hostfile --config_file" in run.stderr
    assert "hf_fake_secret_123" not in run.stderr


@pytest.mark.slow
def test_deepspeed_launcher_over_ssh_matches_ddp(sshd, ddp_reference, tmp_path):
    """The `deepspeed` launcher called directly (for what Accelerate cannot pass: --ssh_port, --no_ssh_check), with a
    .deepspeed_env written once by hand: the ssh login shells on the hosts get only what it and DeepSpeed export."""
    hostfile = write_hostfile(tmp_path / "hostfile", f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1")
    env_file = tmp_path / "deepspeed_env"
    settings = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json",
                "ACCELERATE_MIXED_PRECISION": "no", "OMP_NUM_THREADS": "1", "TRAINKIT_CPU_THREADS": "1",
                "HF_DATASETS_OFFLINE": "1", "TRAINKIT_CACHE": ENV["TRAINKIT_CACHE"]}
    env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))  # KEY=VALUE lines only
    written = env_file.read_text()
    env = {**ENV, "PDSH_SSH_ARGS_APPEND": f"-F {sshd.config}", "DS_ENV_FILE": str(env_file)}
    out = tmp_path / "out"
    log_start = len(sshd.log.read_text())
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--launcher", "pdsh",
           "--ssh_port", str(sshd.port), "--no_ssh_check", "--no_local_rank", "--master_addr", HOSTS[0],
           "--master_port", str(free_port()), "train.py", "--output_dir", str(out), "--report_to", "none", *MLP]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    run = Run("deepspeed --hostfile", proc.returncode, proc.stdout, proc.stderr, out)
    diff = check_deepspeed_run(run, ddp_reference)
    print(f"\ndeepspeed --hostfile over ssh (2 hosts x 1) vs ddp.yaml: max relative loss difference {diff:.2e}")
    assert_both_hosts_reached(sshd, log_start)
    assert env_file.read_text() == written  # read, never appended to


# --- the hostfile pre-flight (--dry_run) ---------------------------------------------------------------------------

def hostfile_launch(hostfile: Path, world_size: int = 2, num_machines: int = 2, **settings: str) -> Launch:
    """deepspeed_hostfile.yaml with another hostfile, process count or deepspeed_config keys (its filters)."""
    launch = Launch.from_yaml(str(ROOT / "accelerate_configs" / "deepspeed_hostfile.yaml"))
    return dataclasses.replace(launch, world_size=world_size, num_machines=num_machines,
                               settings={**launch.settings, "deepspeed_hostfile": str(hostfile), **settings})


def host_problems(launch: Launch) -> list[str]:
    return [str(p) for p in check_hosts(launch)]


@pytest.mark.slow
def test_preflight_reaches_every_host_and_names_the_one_that_fails(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", f"-F {sshd.config}")  # what pdsh will use, the check uses too
    good = write_hostfile(tmp_path / "good", f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1")
    assert host_problems(hostfile_launch(good)) == []
    # 127.0.0.3 is a loopback address where no sshd listens: refused at once
    bad = write_hostfile(tmp_path / "bad", f"{HOSTS[0]} slots=1", "127.0.0.3 slots=1")
    problems = host_problems(hostfile_launch(bad))
    assert len(problems) == 1, problems
    assert problems[0].startswith("host 127.0.0.3 does not answer over ssh: ") and "refused" in problems[0]
    assert f"deepspeed_hostfile {bad}" in problems[0] and "ssh-copy-id 127.0.0.3" in problems[0]


@pytest.mark.slow
def test_dry_run_checks_the_hosts(sshd, tmp_path):
    """--dry_run with the hostfile YAML: exit 2 with an error line naming the host that does not answer."""
    hostfile = write_hostfile(tmp_path / "hostfile", f"{HOSTS[0]} slots=1", "127.0.0.3 slots=1")
    yaml_file = tmp_path / "cluster.yaml"
    yaml_file.write_text((ROOT / "accelerate_configs" / "deepspeed_hostfile.yaml").read_text()
                         .replace("deepspeed_hostfile: hostfile", f"deepspeed_hostfile: {hostfile}"))
    env = {**ENV, "PDSH_SSH_ARGS_APPEND": f"-F {sshd.config}"}
    proc = subprocess.run([sys.executable, "train.py", "--recipe", "mlp", "--dry_run", "--accelerate_config",
                           str(yaml_file)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: host 127.0.0.3 does not answer over ssh: "), proc.stderr
    hostfile.write_text(f"{HOSTS[0]} slots=1\n{HOSTS[1]} slots=1\n")
    proc = subprocess.run([sys.executable, "train.py", "--recipe", "mlp", "--dry_run", "--accelerate_config",
                           str(yaml_file)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and '"num_machines": 2' in proc.stdout, proc.stderr


def test_preflight_checks_that_the_slots_add_up(tmp_path):
    """Everything but ssh is checked first, and without a network: these hosts are never contacted."""
    three = write_hostfile(tmp_path / "three", "a slots=1", "b slots=1", "c slots=1")
    assert host_problems(hostfile_launch(three)) == [
        f"{three} lists 3 host(s) but num_machines is 2 (without a filter DeepSpeed starts ranks on every host of "
        f"the file) (deepspeed_hostfile {three} in {ROOT / 'accelerate_configs' / 'deepspeed_hostfile.yaml'}): "
        f"list exactly num_machines hosts, or select some with deepspeed_inclusion_filter"]
    small = write_hostfile(tmp_path / "small", "a slots=2", "b slots=1")
    [problem] = host_problems(hostfile_launch(small, world_size=4))
    assert problem.startswith("host b has 1 slot(s) but each machine runs num_processes / num_machines = 2 "
                              "process(es); the slots add up to 3, num_processes is 4")
    [problem] = host_problems(hostfile_launch(three, deepspeed_exclusion_filter="c:0", world_size=3))
    assert problem.startswith("the filtered hostfile gives 2 slot(s) on 2 host(s), the launch asks for "
                              "num_processes 3 on num_machines 2")
    [problem] = host_problems(hostfile_launch(three, deepspeed_inclusion_filter="a@d"))
    assert problem.startswith("host d in the inclusion filter is not in ")
    broken = write_hostfile(tmp_path / "broken", "a slots=1", "b", "a slots=2")
    assert [p.split(" (")[0] for p in host_problems(hostfile_launch(broken))] == [
        f"line 3 of {broken} is not `HOSTNAME slots=N`: 'b'", f"host a is listed twice in {broken}, again on line 4"]
    assert host_problems(hostfile_launch(tmp_path / "missing"))[0].startswith(
        f"cannot read the hostfile {tmp_path / 'missing'}: No such file or directory")
    assert "Accelerate then ignores the hostfile" in host_problems(hostfile_launch(three, num_machines=1))[0]


def test_launch_reads_the_machine_count_of_both_launchers(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "LOCAL_SIZE", "CROSS_SIZE",
                 "TRAINKIT_DIST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    # torchrun, 2 machines x 3 processes
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert Launch.from_env().num_machines == 2
    # DeepSpeed's launcher, 3 hosts x 2 processes: LOCAL_SIZE and CROSS_SIZE, no LOCAL_WORLD_SIZE
    for name in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.setenv("CROSS_SIZE", "3")
    assert Launch.from_env().num_machines == 3 and Launch.from_env().world_size == 6
    monkeypatch.setenv("TRAINKIT_DIST_TIMEOUT", "45")
    assert Launch.from_env().dist_timeout_s == 45.0
    monkeypatch.setenv("TRAINKIT_DIST_TIMEOUT", "soon")
    with pytest.raises(Exception, match="TRAINKIT_DIST_TIMEOUT='soon' is not a positive number of seconds"):
        Launch.from_env()
