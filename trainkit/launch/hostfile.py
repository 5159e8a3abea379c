"""A DeepSpeed hostfile launch: its pre-flight (--dry_run), and a launch that sends the hosts only what they need.

Pre-flight: the hostfile and the inclusion / exclusion filters are read with DeepSpeed's own parsers
(deepspeed.launcher.runner), so what is checked is what DeepSpeed's launcher will do. What this module adds: every
problem at once with the line or host at fault, the slot arithmetic Accelerate asks of the hosts, and an ssh probe.

The environment: for a multi-machine DeepSpeed launch, `accelerate launch` appends the launching shell's whole
environment to ./.deepspeed_env (mode 644, left behind), and DeepSpeed's runner sends every line of it as an `export`
on each host's pdsh command line, which any local user's process list shows: tokens and keys included. So launch
with this module instead; it runs the same `accelerate launch` with only the ALLOWED variables (and those the user
lists in ~/.deepspeed_env), through a private file that it removes afterwards:

    python -m trainkit.launch.hostfile --config_file accelerate_configs/deepspeed_hostfile.yaml train.py --recipe
    tiny_transformer
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from trainkit.errors import Problem
from trainkit.launch.launcher import Launch, read_yaml


def check_hosts(launch: Launch, timeout_s: float = 5.0) -> list[Problem]:
    """Problems with a DeepSpeed hostfile launch, each naming its host or line; [] when there is no hostfile.

    Without a filter every host runs num_processes / num_machines ranks; with one, exactly the selected slots.
    Either way num_processes ranks on num_machines hosts. Then every host must answer `ssh -o BatchMode=yes -o
    ConnectTimeout=...` (plus $PDSH_SSH_ARGS_APPEND, which pdsh will add too) within timeout_s, all hosts at once.
    """
    settings = launch.settings
    if launch.distributed_type != "DEEPSPEED" or not settings.get("deepspeed_hostfile"):
        return []
    path = Path(settings["deepspeed_hostfile"])
    where = f"deepspeed_hostfile {path} in {launch.source}"
    include = str(settings.get("deepspeed_inclusion_filter") or "")
    exclude = str(settings.get("deepspeed_exclusion_filter") or "")
    if launch.num_machines < 2:
        return [Problem(f"a hostfile is given but num_machines is {launch.num_machines}: Accelerate then ignores "
                        f"the hostfile and runs on this machine only", launch.source,
                        "set num_machines to the number of hosts, or remove deepspeed_hostfile")]
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        return [Problem(f"cannot read the hostfile {path}: {e.strerror}", where,
                        "create it (see ./hostfile) or point deepspeed_hostfile at it; relative paths start from "
                        "the directory you launch from")]
    slots, problems = _read_slots(lines, path, where)
    if problems:
        return problems
    if include and exclude:
        return [Problem("both deepspeed_inclusion_filter and deepspeed_exclusion_filter are set", launch.source,
                        "keep one of them")]
    spec, kind = (include, "inclusion") if include else (exclude, "exclusion")
    problems = _filter_problems(slots, spec, kind, path, launch)
    if problems:
        return problems
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to stdout; --dry_run's stdout is JSON
        from deepspeed.launcher.runner import parse_inclusion_exclusion
    used = parse_inclusion_exclusion(slots, include, exclude)  # without a filter: every slot of every host
    if spec:
        total = sum(len(s) for s in used.values())
        if total != launch.world_size or len(used) != launch.num_machines:
            problems.append(Problem(f"the filtered hostfile gives {total} slot(s) on {len(used)} host(s), the launch "
                                    f"asks for num_processes {launch.world_size} on num_machines "
                                    f"{launch.num_machines}", where,
                                    "change the filter, or num_processes / num_machines to match it"))
    else:
        problems += _slots_per_host(slots, launch, path, where)
    if problems:
        return problems
    return _probe(list(used), launch, path, where, timeout_s, settings.get("deepspeed_multinode_launcher", "pdsh"))


@contextlib.contextmanager
def _deepspeed_logger_off() -> Iterator[None]:
    from deepspeed.utils import logger

    was, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was



def _read_slots(lines: list[str], path: Path, where: str) -> tuple[dict[str, int], list[Problem]]:
    """The hostfile's slots per host, read with DeepSpeed's own parser, and a problem for each bad or repeated line
    (its parser stops at the first bad line; fed one line at a time it names every one)."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to stdout; --dry_run's stdout is JSON
        from deepspeed.launcher.runner import _parse_hostfile
    problems: list[Problem] = []
    slots: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.strip().startswith("#"):
            continue
        try:
            with _deepspeed_logger_off():  # it logs each bad line as an error; the problem below says more
                [(host, count)] = _parse_hostfile([line]).items()
        except ValueError:
            problems.append(Problem(f"line {number} of {path} is not `HOSTNAME slots=N`: {line.strip()!r}", where,
                                    "write one `HOSTNAME slots=N` per machine"))
            continue
        if host in slots:
            problems.append(Problem(f"host {host} is listed twice in {path}, again on line {number}", where,
                                    "list each host once, with all its slots"))
        slots.setdefault(host, count)
    if not slots and not problems:
        problems.append(Problem(f"{path} lists no hosts", where, "add one `HOSTNAME slots=N` line per machine"))
    return slots, problems

def _filter_problems(slots: dict[str, int], spec: str, kind: str, path: Path, launch: Launch) -> list[Problem]:
    """Every host or slot that the filter names and the hostfile lacks (DeepSpeed stops at the first)."""
    from deepspeed.launcher.runner import parse_node_config_list

    if not spec:
        return []
    try:
        named = parse_node_config_list(spec)
    except ValueError:
        return [Problem(f"the {kind} filter {spec!r} is not NAME[:SLOT[,SLOT...]][@NAME...]", launch.source,
                        "write it like worker-0@worker-1:0,1")]
    problems = []
    for host, wanted in named.items():
        if host not in slots:
            problems.append(Problem(f"host {host} in the {kind} filter is not in {path}", launch.source,
                                    f"use one of {', '.join(slots)}"))
            continue
        missing = [s for s in wanted if s >= slots[host]]
        if missing:
            problems.append(Problem(f"host {host} has {slots[host]} slot(s), the filter names slot(s) "
                                    f"{', '.join(map(str, missing))}", launch.source,
                                    f"use slots 0..{slots[host] - 1}"))
    return problems


def _slots_per_host(slots: dict[str, int], launch: Launch, path: Path, where: str) -> list[Problem]:
    """Without a filter Accelerate asks every host of the file for num_processes / num_machines ranks."""
    problems = []
    per_host = launch.world_size // launch.num_machines
    if launch.world_size % launch.num_machines:
        problems.append(Problem(f"num_processes {launch.world_size} does not divide into num_machines "
                                f"{launch.num_machines}", launch.source,
                                "make num_processes a multiple of num_machines: it is the total over all hosts"))
    if len(slots) != launch.num_machines:
        problems.append(Problem(f"{path} lists {len(slots)} host(s) but num_machines is {launch.num_machines} "
                                f"(without a filter DeepSpeed starts ranks on every host of the file)", where,
                                "list exactly num_machines hosts, or select some with deepspeed_inclusion_filter"))
    for host, n in slots.items():
        if n < per_host:
            problems.append(Problem(f"host {host} has {n} slot(s) but each machine runs num_processes / "
                                    f"num_machines = {per_host} process(es); the slots add up to "
                                    f"{sum(slots.values())}, num_processes is {launch.world_size}", where,
                                    f"give {host} slots={per_host} or more, or lower num_processes"))
    return problems


def _probe(hosts: list[str], launch: Launch, path: Path, where: str, timeout_s: float,
           multinode_launcher: str) -> list[Problem]:
    """Every host must answer over ssh without a password, as pdsh will ask it to."""
    problems = []
    if multinode_launcher == "pdsh" and not shutil.which("pdsh"):
        problems.append(Problem("pdsh is not installed on this machine", launch.source,
                                "install it (apt-get install pdsh) or choose another deepspeed_multinode_launcher"))
    if not shutil.which("ssh"):
        return problems + [Problem("no ssh client on this machine", launch.source, "install openssh-client")]
    extra = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))

    def answer(host: str) -> str | None:
        command = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout_s))}", *extra, host,
                   "true"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s + 5,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout_s + 5:.0f} s"
        if done.returncode == 0:
            return None
        said = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return said[-1] if said else f"ssh exited with status {done.returncode}"

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        for host, failure in zip(hosts, pool.map(answer, hosts), strict=True):
            if failure:
                problems.append(Problem(f"host {host} does not answer over ssh: {failure}", where,
                                        f"make `ssh {host} true` work without a password from this machine "
                                        f"(ssh-copy-id {host}), check that it resolves and runs sshd, or remove it "
                                        f"from {path}"))
    return problems


# What the ranks on other hosts may be sent: names, and name prefixes. The hosts' own login shells provide the rest.
ALLOWED_NAMES = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TERM", "TZ", "TMPDIR", "PYTHONPATH",
                 "PYTHONUNBUFFERED", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LD_LIBRARY_PATH",
                 "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HOME",
                 "HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                 "PDSH_RCMD_TYPE", "PDSH_SSH_ARGS_APPEND", "SSH_AUTH_SOCK", "DS_ENV_FILE"}
ALLOWED_PREFIXES = ("LC_", "TRAINKIT_", "ACCELERATE_", "NCCL_", "GLOO_", "TORCH_", "MASTER_", "DS_", "UCX_")
# Never sent, allowed name or not: what tokens, keys and passwords are called.
SECRET = re.compile(r"TOKEN(?!IZERS)|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE|(?<!SSH_)AUTH", re.IGNORECASE)


def allowed_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The variables that may travel to the hosts, and the names of those left out."""
    def allowed(name: str) -> bool:
        return (name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)) and not SECRET.search(name)

    kept = {k: v for k, v in environ.items() if allowed(k)}
    return kept, sorted(set(environ) - set(kept))


def secret_names(environ: Mapping[str, str]) -> list[str]:
    return sorted(name for name in environ if SECRET.search(name) and name != "SSH_AUTH_SOCK")


# Set by main() for the launch it starts; it reaches the ranks with the allowed variables (a TRAINKIT_ name). A rank
# of a multi-machine DeepSpeed launch without it was started by `accelerate launch` (or DeepSpeed's runner) directly.
HOSTS_LAUNCH = "TRAINKIT_HOSTS_LAUNCH"


def exposed_secrets(environ: Mapping[str, str], local_main: bool) -> str | None:
    """In a rank of a hostfile launch that did not come through this module: which secret-looking variables of the
    launching shell were sent, and where they went, or None. The first process of each machine removes the
    ./.deepspeed_env that `accelerate launch` left in the launch folder (the ranks run there), which holds them in
    plain text; a DS_ENV_FILE the user named is theirs, only named. Training goes on (docs/multi-node.md says why)."""
    if int(environ.get("CROSS_SIZE", "1")) < 2 or HOSTS_LAUNCH in environ or not (names := secret_names(environ)):
        return None
    env_file = Path(environ.get("DS_ENV_FILE", ".deepspeed_env"))
    if "DS_ENV_FILE" in environ:
        file = f"in {env_file}, which DS_ENV_FILE names (delete the lines that hold them)"
    else:
        file = f"in {env_file.absolute()} (mode 644; removed now)"
        if local_main:
            env_file.unlink(missing_ok=True)
    return (f"this hostfile launch did not come through `python -m trainkit.launch.hostfile`, so the launching shell's "
            f"{', '.join(names)} went to every host: on the launcher's output (its `cmd = pdsh ... export ...` "
            f"line), on each host's pdsh and ssh command lines (any local user's process list shows them), in every "
            f"rank's environment, and {file}. Rotate them, and launch with `python -m trainkit.launch.hostfile "
            f"--config_file <the YAML> train.py ...`, which sends only the variables trainkit/launch/hostfile.py "
            "allows")


def environment_note(launch: Launch) -> str | None:
    """For --dry_run of a hostfile launch: which secret-looking variables `accelerate launch` would send."""
    if launch.distributed_type != "DEEPSPEED" or not launch.settings.get("deepspeed_hostfile") or \
            launch.num_machines < 2 or not (names := secret_names(os.environ)):
        return None
    return (f"this shell holds {', '.join(names)}: `accelerate launch` with {launch.source} would write them into "
            f"./.deepspeed_env and onto every host's command line; launch with `python -m trainkit.launch.hostfile "
            f"--config_file {launch.source} train.py ...`, which sends only the variables "
            "trainkit/launch/hostfile.py allows")


def rendezvous_note(launch: Launch) -> str | None:
    """For --dry_run of a one-launch-per-machine YAML (multinode.yaml): what each machine's launch waits for before
    train.py starts. torchrun's agent, not train.py, does that wait, and says nothing while it waits: a machine 0
    whose partners never come printed nothing for 15 minutes here, then `DistStoreError: ... 1/2 clients joined`."""
    if launch.num_machines < 2 or launch.settings.get("deepspeed_hostfile") or not launch.source.endswith(
            (".yaml", ".yml")):
        return None
    data = read_yaml(launch.source)
    where = f"{data.get('main_process_ip', '<main_process_ip>')}:{data.get('main_process_port', 29500)}"
    return (f"each machine's `accelerate launch` waits for all {launch.num_machines} machines at {where} (the YAML's "
            f"main_process_ip:main_process_port, unless the launch's flags set others) before "
            f"train.py starts, silently, and gives up after torchrun's rendezvous timeout (600 s for "
            f"rdzv_backend static; `accelerate launch --rdzv_conf timeout=SECONDS ...` sets another): start every "
            f"machine's launch, each with its own --machine_rank")


def main(argv: list[str] | None = None) -> int:
    """`accelerate launch ARGV` with only the allowed environment; the hosts' variables go through a private file."""
    argv = sys.argv[1:] if argv is None else argv
    env, dropped = allowed_environment(os.environ)
    env[HOSTS_LAUNCH] = "1"
    leftover = Path(".deepspeed_env")
    if leftover.is_file() and (names := secret_names(dict.fromkeys(
            line.partition("=")[0] for line in leftover.read_text(errors="replace").splitlines()))):
        print(f"note: {leftover.absolute()} is left from an earlier `accelerate launch` of a hostfile YAML and holds "
              f"{', '.join(names)} in plain text; this launch does not read it: delete it (rm {leftover})",
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="trainkit-hosts-") as private:  # mode 700, removed on the way out
        env_file = Path(private) / "deepspeed_env"
        # DS_ENV_FILE replaces ~/.deepspeed_env for DeepSpeed's runner: what the user wrote there is carried over.
        user_file = Path.home() / ".deepspeed_env"
        env_file.write_text(user_file.read_text() if user_file.is_file() else "")
        env_file.chmod(0o600)
        env["DS_ENV_FILE"] = str(env_file)
        if dropped:
            secrets = secret_names(os.environ)
            print(f"note: {len(dropped)} variable(s) of this shell are not sent to the hosts"
                  + (f", among them {', '.join(secrets)}" if secrets else "") + " (the allow-list is in "
                  "trainkit/launch/hostfile.py; list what the ranks need in ~/.deepspeed_env)",
              file=sys.stderr, flush=True)
        return launch_passing_signals([sys.executable, "-m", "accelerate.commands.launch", *argv], env, argv)


# After a stop was asked for, how long the launch's end may come before the run's record of it: each host's DeepSpeed
# launcher gives its ranks 30 s to end (deepspeed/launcher/launch.py) while the runner here returns after 1 s.
STOP_RECORD_WAIT_S = 35


def launch_passing_signals(cmd: list[str], env: Mapping[str, str], argv: list[str]) -> int:
    """Run the launch; SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C) are passed on to its launchers rather
    than ending this process first, whose private env file is then removed only after the launch. A stop the run
    recorded (stopped.json in its --output_dir: every rank stopped at one step with a checkpoint) exits 0, so that a
    script tells it from a crash; DeepSpeed's runner itself exits 1 after passing on a signal.

    With `--max_restarts N` (accelerate launch's flag, which DeepSpeed's pdsh launcher ignores) a launch that failed
    is started again, up to N times, unless it was stopped or refused its arguments (exit 2): with `--resume auto`
    the run continues from its newest checkpoint."""
    from trainkit.run.output_folder import STOP_RECORD

    output_dir, restarts = _output_dir(argv), _max_restarts(argv)
    record = output_dir / STOP_RECORD if output_dir else None
    started, received, child = time.time(), [], None

    def pass_on(signum: int, frame: object) -> None:
        """To `accelerate launch` and the launcher it started: DeepSpeed's runner, which has each host's launcher
        stop its ranks (accelerate launch itself passes nothing on, and pdsh or ssh must not get it: a closed
        connection would end a host's launcher, and its ranks, before they saved)."""
        received.append(signum)
        with contextlib.suppress(psutil.Error, AttributeError):
            launch = psutil.Process(child.pid)
            for process in [*launch.children(), launch]:
                process.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(restarts + 1):
            child = subprocess.Popen(cmd, env=dict(env), start_new_session=True)  # signals reach it through here
            status = child.wait()
            if received or status in (0, 2) or attempt == restarts:
                break
            print(f"note: the launch failed (exit {status}); starting it again ({attempt + 1} of --max_restarts "
                  f"{restarts})", file=sys.stderr, flush=True)
        deadline = time.time() + STOP_RECORD_WAIT_S
        while received and record is not None and not _written_since(record, started) and time.time() < deadline:
            time.sleep(0.5)  # the hosts' ranks still writing their checkpoint
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and record is not None and _written_since(record, started):
        print(f"the launch stopped on {signal.Signals(received[0]).name} with a checkpoint ({record}): exit 0",
              file=sys.stderr, flush=True)
        return 0
    return status


def _max_restarts(argv: list[str]) -> int:
    """accelerate launch's --max_restarts in the launch's arguments (before the script), else 0."""
    from accelerate.commands.launch import launch_command_parser

    script = next((i for i, arg in enumerate(argv) if arg.endswith(".py")), len(argv))
    with contextlib.suppress(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        return launch_command_parser().parse_known_args([*argv[:script], "train.py"])[0].max_restarts or 0
    return 0


def _output_dir(argv: list[str]) -> Path | None:
    """train.py's --output_dir in the launch's arguments (what follows the script), by train.py's own parser."""
    from trainkit.command_line import parse_command_line

    script = next((i for i, arg in enumerate(argv) if arg.endswith(".py")), None)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage lines: train.py itself reports its mistakes
            return parse_command_line(argv[script + 1:])[0].output_dir if script is not None else None
    except SystemExit:  # not train.py's arguments: there is no record to read
        return None


def _written_since(path: Path, started: float) -> bool:
    return path.is_file() and path.stat().st_mtime >= started


if __name__ == "__main__":
    sys.exit(main())
