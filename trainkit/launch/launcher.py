"""What the launcher asked for, and whether this machine can do it.

`Launch` is read from the environment that `accelerate launch` (or DeepSpeed's launcher) sets up for every process,
or from an Accelerate YAML for `--dry_run --accelerate_config`. Either way the strategy's own block (the YAML's
`deepspeed_config` or `fsdp_config`) arrives under the YAML's key names in `Launch.settings`, and the sizes of its
`parallelism_config` block (tensor parallelism, hybrid sharding) in `Launch.parallelism`, so a strategy reads one form
whichever way the launch came. `check_yaml` lints a YAML file; `check_machine` refuses what this machine cannot
run (bf16 on a GPU that only emulates it, more processes than GPUs) and a launch that starts fewer processes than
it was asked for. fp16 on a CPU is the strategy's to allow or refuse (Strategy.cpu_fp16_refusal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from trainkit.errors import ConfigError, Problem

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "accelerate_configs"
PRECISIONS = ("no", "bf16", "fp16")
# Accelerate's distributed types that this runner trains under; MULTI_CPU is what MULTI_GPU becomes without GPUs.
DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP")
# The types that `accelerate launch` starts as one process whatever num_processes says (MULTI_CPU starts several only
# under mpirun: its mpirun_config).
ONE_PROCESS_TYPES = ("NO", "MULTI_CPU")

# How `accelerate launch` hands the YAML's strategy block to each process: one environment variable per key
# (accelerate/utils/launch.py). Read back under the YAML's names.
DEEPSPEED_ENV = {
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
}
FSDP_ENV = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_activation_checkpointing_offload": "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
    "fsdp_ignored_modules": "FSDP_IGNORED_MODULES",
}

# The sizes of a YAML's `parallelism_config` block, each key written in full (parallelism_config_tp_size: 2): how
# `accelerate launch` hands them to every process (accelerate/utils/launch.py, prepare_extend_env_parallelism_config).
# Read back as Launch.parallelism under the short names.
PARALLELISM_KEY = "parallelism_config_{}_size"
PARALLELISM_ENV = {name: f"PARALLELISM_CONFIG_{name.upper()}_SIZE" for name in ("dp_replicate", "dp_shard", "tp",
                                                                                 "cp", "sp")}
# Sizes of the block that this runner reads and Accelerate has no option for, so `accelerate launch` passes them to no
# process: each rank reads them from its launcher's YAML (launcher_sizes), or from PARALLELISM_CONFIG_<NAME>_SIZE
# where it was started without Accelerate. ep: the ranks that split a mixture of experts' experts between them
# (strategies/expert_parallel.py).
RUNNER_SIZES = {"ep": "PARALLELISM_CONFIG_EP_SIZE"}


NO_LAUNCHER = "no launcher"  # Launch.source of `python train.py` with no --accelerate_config


def is_true(value: Any) -> bool:
    """A YAML or environment boolean: true, 1, yes (any case)."""
    return str(value).lower() in ("1", "true", "yes")


@dataclass(frozen=True, slots=True)
class Launch:
    """What the launcher asked for, before any process group exists."""

    distributed_type: str  # one of DISTRIBUTED_TYPES
    world_size: int
    num_machines: int
    mixed_precision: str  # no | bf16 | fp16
    source: str  # where these values came from, for messages
    settings: Mapping[str, Any] = field(default_factory=dict)  # the YAML's deepspeed_config / fsdp_config block
    # Every key name of that block as written. Under a launcher Accelerate passes only the values of the keys it
    # knows, but the names of all (ACCELERATE_CONFIG_DS_FIELDS): a typo is then seen at launch as in a dry run.
    block_keys: tuple[str, ...] = ()
    # Seconds a collective waits for the other ranks before it fails (TRAINKIT_DIST_TIMEOUT); None: torch's default
    # (30 min over gloo, 10 min over NCCL). What bounds the wait when a machine vanishes without closing its sockets.
    dist_timeout_s: float | None = None
    main_process_ip: str | None = None
    # The YAML's parallelism_config sizes by short name (dp_replicate, dp_shard, tp, cp, sp); empty when it has no
    # such block.
    parallelism: Mapping[str, int] = field(default_factory=dict)
    # The process count the launcher was asked for and where (its --num_processes, its YAML's num_processes), where
    # that can differ from what it started: Accelerate's one-process launcher ignores the count (requested_processes)
    asked: tuple[int, str] | None = None

    @property
    def chosen(self) -> bool:
        """Whether a launch was chosen: a launcher's environment, or the YAML --accelerate_config names."""
        return self.source != NO_LAUNCHER

    @classmethod
    def from_env(cls) -> Launch:
        """The launch as torchrun (`accelerate launch`, one per machine) or DeepSpeed's launcher (a hostfile) set it up.

        torchrun sets WORLD_SIZE, LOCAL_WORLD_SIZE and GROUP_WORLD_SIZE (the number of machines); DeepSpeed's
        launcher sets WORLD_SIZE, LOCAL_SIZE and CROSS_SIZE (the number of machines) and no LOCAL_WORLD_SIZE.
        """
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world_size)
        num_machines = int(env.get("GROUP_WORLD_SIZE") or env.get("CROSS_SIZE") or
                           max(1, world_size // max(1, local_world)))
        if is_true(env.get("ACCELERATE_USE_DEEPSPEED")):
            distributed_type, names = "DEEPSPEED", DEEPSPEED_ENV
        elif is_true(env.get("ACCELERATE_USE_FSDP")):
            distributed_type, names = "FSDP", FSDP_ENV
        else:
            # torchrun (LOCAL_RANK) of a single process too: Accelerate then makes a process group of one
            distributed_type, names = ("MULTI_GPU" if world_size > 1 or "LOCAL_RANK" in env else "NO"), {}
        settings = {key: env[name] for key, name in names.items() if name in env}
        written = [k for k in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if k and k != "mixed_precision"]
        parallelism = {**{name: int(env[var]) for name, var in PARALLELISM_ENV.items() if var in env},
                       **launcher_sizes(env)} if is_true(env.get("ACCELERATE_USE_PARALLELISM_CONFIG")) else {}
        return cls(distributed_type=distributed_type, world_size=world_size, num_machines=num_machines,
                   mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
                   source="the launcher's environment" if "ACCELERATE_MIXED_PRECISION" in env else NO_LAUNCHER,
                   settings=settings, block_keys=tuple(dict.fromkeys([*settings, *written])),
                   dist_timeout_s=dist_timeout(), main_process_ip=env.get("MASTER_ADDR"), parallelism=parallelism,
                   asked=requested_processes(_launcher_argv()) if _one_process_launcher(env) else None)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Launch:
        """What `accelerate launch --config_file PATH` would ask for (for --dry_run outside a launcher).

        Only an unreadable file or an unknown distributed_type stop here; a process or machine count that is not a
        positive integer reads as 1 and is reported by `check_yaml`, so that every problem is reported at once.
        """
        data = read_yaml(path)
        distributed_type = str(data.get("distributed_type", "NO"))
        if distributed_type not in DISTRIBUTED_TYPES:
            raise ConfigError([Problem(f"distributed_type {distributed_type} is not supported",
                                       f"--accelerate_config {path}", f"use one of {', '.join(DISTRIBUTED_TYPES)}")])
        block = {"DEEPSPEED": "deepspeed_config", "FSDP": "fsdp_config"}.get(distributed_type)
        settings = dict(data.get(block) or {}) if block else {}
        sizes = data.get("parallelism_config") or {}
        sizes = sizes if isinstance(sizes, dict) else {}  # anything else: check_yaml names it
        # Accelerate's default for a size the block leaves out is 1, as in the launcher's environment
        parallelism = {name: _count(sizes.get(PARALLELISM_KEY.format(name), 1)) or 1
                       for name in (*PARALLELISM_ENV, *RUNNER_SIZES)} if sizes else {}
        processes = _count(data.get("num_processes", 1)) or 1
        alone = distributed_type in ONE_PROCESS_TYPES  # what accelerate launch starts for these, whatever the count
        return cls(distributed_type=distributed_type, world_size=1 if alone else processes,
                   num_machines=_count(data.get("num_machines", 1)) or 1,
                   mixed_precision=str(data.get("mixed_precision", "no")).lower(), source=str(path),
                   settings=settings, block_keys=tuple(settings), dist_timeout_s=dist_timeout(),
                   main_process_ip=data.get("main_process_ip"), parallelism=parallelism,
                   asked=(processes, f"num_processes in {path}") if alone else None)

    def as_launched(self, processes: int | None, machines: int | None) -> Launch:
        """This YAML's launch as `accelerate launch --num_processes N --num_machines M` starts it: the flags win over
        the YAML's values (a SLURM job's pre-flight checks the world of its allocation, examples/slurm.sbatch)."""
        if not processes and not machines:
            return self
        flags = " ".join(f"--{name} {value}" for name, value in (("num_processes", processes),
                                                                 ("num_machines", machines)) if value)
        alone = self.distributed_type in ONE_PROCESS_TYPES
        return dataclasses.replace(
            self, world_size=1 if alone else processes or self.world_size, num_machines=machines or self.num_machines,
            source=f"{self.source} with {flags}",
            asked=(processes, f"--num_processes {processes}") if alone and processes else self.asked)

    def parallelism_size(self, name: str) -> int:
        """One size of the parallelism config (dp_replicate, dp_shard, tp, cp, sp, ep); 1 where the launch gives
        none."""
        return self.parallelism.get(name, 1)


def _one_process_launcher(env: Mapping[str, str]) -> bool:
    """Whether `accelerate launch` started this process with its one-process launcher (it sets ACCELERATE_USE_CPU
    there only; torchrun and DeepSpeed's launcher set LOCAL_RANK)."""
    return "ACCELERATE_USE_CPU" in env and "LOCAL_RANK" not in env


def _launcher_argv() -> list[str]:
    """The parent process's command line (Linux); empty where it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def requested_processes(argv: list[str]) -> tuple[int, str] | None:
    """The process count an `accelerate launch` command line asks for and where: its --num_processes, else its YAML's
    (--config_file, or Accelerate's default config file) num_processes; None for another command or no count.

    Needed because Accelerate's one-process launcher, which it picks for distributed_type NO or MULTI_CPU (without
    mpirun) and for a bare `--num_processes N` on a machine without GPUs, starts one process whatever the count and
    tells it nothing of the count.
    """
    args = launcher_args(argv)
    if args is None:
        return None
    if args.num_processes:
        return args.num_processes, "accelerate launch --num_processes"
    data, path = launcher_yaml(args)
    count = _count(data.get("num_processes"))
    return (count, f"num_processes in {path}") if count else None


def launcher_sizes(env: Mapping[str, str]) -> dict[str, int]:
    """RUNNER_SIZES for this process: from the environment where it names them, else from the parallelism_config
    of the YAML that the `accelerate launch` which started this process (its parent, under torchrun) read; 1 where
    neither gives one."""
    missing = [name for name, var in RUNNER_SIZES.items() if var not in env]
    args = launcher_args(_launcher_argv()) if missing else None
    sizes = (launcher_yaml(args)[0].get("parallelism_config") or {}) if args is not None else {}
    sizes = sizes if isinstance(sizes, dict) else {}
    return {name: int(env[var]) if var in env else _count(sizes.get(PARALLELISM_KEY.format(name), 1)) or 1
            for name, var in RUNNER_SIZES.items()}


def launcher_args(argv: list[str]) -> Any:
    """An `accelerate launch` command line as Accelerate's own parser reads it (an argparse Namespace); None for
    another command, or one that Accelerate would not have run."""
    from accelerate.commands.launch import launch_command_parser

    start = next((i + 1 for i, arg in enumerate(argv) if arg == "launch" or arg.endswith(("accelerate-launch",
                                                                                        "accelerate.commands.launch"))),
                 None)
    if start is None:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage message is not this run's to print
            return launch_command_parser().parse_args(argv[start:])
    except SystemExit:
        return None


def launcher_yaml(args: Any) -> tuple[dict[str, Any], str | None]:
    """The YAML a parsed `accelerate launch` read (its --config_file, or Accelerate's default config file) and its
    path; empty where there is none or it cannot be read (the launcher would have said so)."""
    from accelerate.commands.config import default_config_file

    path = args.config_file or (default_config_file if Path(default_config_file).is_file() else None)
    try:
        return (read_yaml(path) if path else {}), path
    except ConfigError:
        return {}, path


def _count(value: Any) -> int | None:
    """A YAML process or machine count, or None when it is not a positive integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping: YAML keeps the last silently, and so does
    Accelerate, so a setting added below the one already there (fsdp_activation_checkpointing: true under a false)
    would be lost, or win, unseen."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.YAMLError(f"{key} is given twice (the second time on line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """An Accelerate YAML as a dict; a missing or unreadable file, or a key given twice, is a ConfigError naming it."""
    where = f"--accelerate_config {path}"
    try:
        data = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader) or {}
    except FileNotFoundError:
        raise ConfigError([Problem(f"{path} does not exist", where, "pass a file from accelerate_configs/")]) from None
    except yaml.YAMLError as e:
        twice = type(e) is yaml.YAMLError  # _UniqueKeyLoader's
        raise ConfigError([Problem(f"{path}: {e}" if twice else f"{path} is not valid YAML: {e}", where,
                                   "keep one of them: Accelerate would silently take the last" if twice else
                                   "fix the file")]) from None
    if not isinstance(data, dict):
        raise ConfigError([Problem(f"{path} is not a mapping of Accelerate settings", where,
                                   "start from a file in accelerate_configs/")])
    return data


def dist_timeout() -> float | None:
    """TRAINKIT_DIST_TIMEOUT: seconds a collective waits for the other ranks; unset: torch's default."""
    value = os.environ.get("TRAINKIT_DIST_TIMEOUT", "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ConfigError([Problem(f"TRAINKIT_DIST_TIMEOUT={value!r} is not a positive number of seconds",
                                   "the environment variable TRAINKIT_DIST_TIMEOUT",
                                   "set it to e.g. 600, or unset it for torch's default")])
    return seconds


def shipped_configs() -> dict[str, Launch]:
    """Every YAML in accelerate_configs/ by name (file stem). They name their DeepSpeed JSON relative to the
    repository root, where they are launched from; here it is made absolute, to be read from anywhere."""
    launches = {path.stem: Launch.from_yaml(path) for path in sorted(CONFIGS_DIR.glob("*.yaml"))}
    for name, launch in launches.items():
        if "deepspeed_config_file" in launch.settings:
            settings = {**launch.settings,
                        "deepspeed_config_file": str(CONFIGS_DIR.parent / launch.settings["deepspeed_config_file"])}
            launches[name] = dataclasses.replace(launch, settings=settings)
    return launches


def config_path(name_or_path: str) -> Path:
    """A shipped config's name (ddp) or a path to a .yaml."""
    return Path(name_or_path) if name_or_path.endswith(".yaml") else CONFIGS_DIR / f"{name_or_path}.yaml"


def check_yaml(path: str | Path) -> list[Problem]:
    """Unknown keys or values in an Accelerate YAML: Accelerate itself ignores or rejects them late."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    data = read_yaml(path)
    where = f"--accelerate_config {path}"
    known = {f.name for f in dataclasses.fields(ClusterConfig)}
    problems = []
    for key in sorted(set(data) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        problems.append(Problem(f"unknown key {key!r} in {path}", where,
                                f"did you mean {close[0]}?" if close else "remove it"))
    for key in ("num_processes", "num_machines"):
        if key in data and _count(data[key]) is None:
            problems.append(Problem(f"{key} must be a positive integer, got {data[key]!r}", where, f"write {key}: 2"))
    types = {t.value for t in DistributedType}
    if str(data.get("distributed_type", "NO")) not in types:
        problems.append(Problem(f"distributed_type {data.get('distributed_type')!r} is not one of Accelerate's",
                                where, f"use one of {', '.join(DISTRIBUTED_TYPES)}"))
    if data.get("parallelism_config"):
        problems += _check_parallelism_block(data["parallelism_config"], path)
        if data.get("distributed_type") not in ("FSDP", "DEEPSPEED"):
            # accelerate launch passes the sizes on under any type; FSDP (version 2) applies them, DeepSpeed its
            # sequence-parallel size (trainkit/strategies/deepspeed.py)
            problems.append(Problem(f"parallelism_config needs distributed_type: FSDP (or DEEPSPEED for "
                                    f"parallelism_config_sp_size), the YAML has {data.get('distributed_type')}",
                                    where, "start from accelerate_configs/tp.yaml, fsdp_tp.yaml, hsdp.yaml or "
                                    "deepspeed_zero3_sp.yaml"))
    return problems


def _check_parallelism_block(block: Any, path: str | Path) -> list[Problem]:
    """The `parallelism_config` block: `accelerate launch` copies each key as written onto its own arguments, so a
    key that is neither one of its `parallelism_config_*` options nor one the runner reads itself (RUNNER_SIZES)
    (`tp_size: 2`) is silently ignored."""
    from accelerate.commands.launch import launch_command_parser

    where = f"parallelism_config in {path}"
    if not isinstance(block, dict):
        return [Problem(f"parallelism_config must be a mapping of sizes, got {block!r}", where,
                        "write parallelism_config_tp_size: 2 (and the others) indented under it")]
    known = sorted([*(a.dest for a in launch_command_parser()._actions if a.dest.startswith("parallelism_config_")),
                    *(PARALLELISM_KEY.format(name) for name in RUNNER_SIZES)])
    problems = []
    for key in sorted(set(block) - set(known)):
        close = difflib.get_close_matches(key, known, n=1) or difflib.get_close_matches(PARALLELISM_KEY.format(
            key.removesuffix("_size")), known, n=1)
        problems.append(Problem(f"unknown key {key!r} in parallelism_config", where,
                                f"did you mean {close[0]}?" if close else "remove it"))
    for name in (*PARALLELISM_ENV, *RUNNER_SIZES):
        key = PARALLELISM_KEY.format(name)
        if key in block and _count(block[key]) is None:
            problems.append(Problem(f"{key} must be a positive integer, got {block[key]!r}", where, f"write {key}: 2"))
    return problems


def check_machine(launch: Launch) -> list[Problem]:
    """What this machine cannot run: the precision on this device, more processes than GPUs; and fewer processes
    than asked for."""
    problems = []
    on_gpu = torch.cuda.is_available()
    where = f"mixed_precision from {launch.source}"
    if launch.mixed_precision not in PRECISIONS:
        problems.append(Problem(f"unknown precision {launch.mixed_precision!r}", where,
                                f"use one of {', '.join(PRECISIONS)}"))
    if launch.mixed_precision == "bf16" and on_gpu and not torch.cuda.is_bf16_supported(including_emulation=False):
        # Accelerate and DeepSpeed accept it (torch emulates bf16 there), and the run is many times slower than fp16.
        problems.append(Problem(f"bf16 needs a GPU with bf16 arithmetic (Ampere or newer); "
                                f"{torch.cuda.get_device_name()} only emulates it, many times slower", where,
                                "use --mixed_precision fp16 on this GPU"))
    if launch.asked and launch.asked[0] > launch.world_size:
        problems.append(Problem(
            f"{launch.asked[0]} processes asked for, but this launch runs {launch.world_size}: accelerate launch "
            "starts one for distributed_type NO or MULTI_CPU (without mpirun), and for --num_processes without a "
            "multi-process config on a machine without GPUs", launch.asked[1],
            "launch with --config_file accelerate_configs/ddp.yaml or another multi-process config (on a machine "
            "without GPUs their processes train over gloo)"))
    if on_gpu and launch.world_size > torch.cuda.device_count() * launch.num_machines:
        problems.append(Problem(f"{launch.world_size} processes but {torch.cuda.device_count()} GPU(s) per machine",
                                f"num_processes from {launch.source}", "pass --num_processes <= the GPU count"))
    return problems
