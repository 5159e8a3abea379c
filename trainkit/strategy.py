"""The one place that knows the distributed strategies (single, DDP, DeepSpeed, FSDP2) and their CPU quirks.

`Launch` is what the launcher asked for: read from the environment that `accelerate launch` sets up, or from an
Accelerate YAML for a dry run. `check_launch` finds what cannot work before anything is built; `build_accelerator`
turns the launch into an Accelerator that does exactly that on this machine, and `verify_accelerator` refuses to
train when Accelerate ended up doing something else. `Strategy` then prepares the model and optimizer and answers
the few questions the loop has (gradient norm, full weights). Each trap in ../shared/PITFALLS.md is handled where
its comment names it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml

from trainkit.config import ConfigError, TrainConfig, problem

PRECISIONS = ("no", "bf16", "fp16")
KINDS = {"NO": "single", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "DEEPSPEED": "deepspeed", "FSDP": "fsdp"}


def _true(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "yes")


@dataclass(frozen=True, slots=True)
class Launch:
    """What the launcher asked for, before any process group exists."""

    kind: str  # single | ddp | deepspeed | fsdp
    world_size: int
    num_machines: int
    mixed_precision: str  # no | bf16 | fp16
    source: str  # where these values came from, for messages
    deepspeed_config: str | None = None  # the DeepSpeed JSON
    deepspeed_inline: bool = False  # DeepSpeed settings given in the YAML instead of a JSON
    fsdp_version: int = 2
    fsdp_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    # Seconds a collective waits for the other ranks before it fails (TRAINKIT_DIST_TIMEOUT); None: torch's default
    # (30 min over gloo, 10 min over NCCL). What bounds the wait when a machine vanishes without closing its sockets.
    dist_timeout_s: float | None = None
    # DeepSpeed's multi-machine launcher (deepspeed_config in the YAML; only for --dry_run's pre-flight, check_hosts)
    hostfile: str | None = None
    hostfile_include: str = ""  # deepspeed_inclusion_filter: NAME[:SLOT,...][@NAME...]
    hostfile_exclude: str = ""  # deepspeed_exclusion_filter
    multinode_launcher: str = "pdsh"
    main_process_ip: str | None = None

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
        if _true(env.get("ACCELERATE_USE_DEEPSPEED")):
            kind = "deepspeed"
        elif _true(env.get("ACCELERATE_USE_FSDP")):
            kind = "fsdp"
        else:
            kind = "ddp" if world_size > 1 else "single"
        return cls(kind=kind, world_size=world_size, num_machines=num_machines,
                   mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
                   source="the launcher's environment" if "ACCELERATE_MIXED_PRECISION" in env else "no launcher",
                   deepspeed_config=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
                   deepspeed_inline=kind == "deepspeed" and "ACCELERATE_DEEPSPEED_CONFIG_FILE" not in env,
                   fsdp_version=int(env.get("FSDP_VERSION", "2")),
                   fsdp_offload=_true(env.get("FSDP_OFFLOAD_PARAMS")),
                   fsdp_reshard_after_forward=_true(env.get("FSDP_RESHARD_AFTER_FORWARD", "true")),
                   dist_timeout_s=cls._dist_timeout(), main_process_ip=env.get("MASTER_ADDR"))

    @classmethod
    def from_yaml(cls, path: str) -> Launch:
        """What `accelerate launch --config_file PATH` would ask for (for --dry_run outside a launcher)."""
        where = f"--accelerate_config {path}"
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError([problem(f"{path} does not exist", where,
                                       "pass a file from accelerate_configs/")]) from None
        except yaml.YAMLError as e:
            raise ConfigError([problem(f"{path} is not valid YAML: {e}", where, "fix the file")]) from None
        distributed_type = str(data.get("distributed_type", "NO"))
        if distributed_type not in KINDS:
            raise ConfigError([problem(f"distributed_type {distributed_type} is not supported", where,
                                       f"use one of {', '.join(KINDS)}")])
        world_size = int(data.get("num_processes", 1))
        kind = KINDS[distributed_type]
        if kind == "ddp" and world_size == 1:
            kind = "single"
        ds = data.get("deepspeed_config") or {}
        fsdp = data.get("fsdp_config") or {}
        return cls(kind=kind, world_size=world_size, num_machines=int(data.get("num_machines", 1)),
                   mixed_precision=str(data.get("mixed_precision", "no")).lower(), source=path,
                   deepspeed_config=ds.get("deepspeed_config_file"),
                   deepspeed_inline=kind == "deepspeed" and "deepspeed_config_file" not in ds,
                   fsdp_version=int(fsdp.get("fsdp_version", 2)),
                   fsdp_offload=_true(fsdp.get("fsdp_offload_params", False)),
                   fsdp_reshard_after_forward=_true(fsdp.get("fsdp_reshard_after_forward", True)),
                   dist_timeout_s=cls._dist_timeout(),
                   hostfile=ds.get("deepspeed_hostfile") if kind == "deepspeed" else None,
                   hostfile_include=str(ds.get("deepspeed_inclusion_filter") or ""),
                   hostfile_exclude=str(ds.get("deepspeed_exclusion_filter") or ""),
                   multinode_launcher=str(ds.get("deepspeed_multinode_launcher") or "pdsh"),
                   main_process_ip=data.get("main_process_ip"))

    @staticmethod
    def _dist_timeout() -> float | None:
        """TRAINKIT_DIST_TIMEOUT: seconds a collective waits for the other ranks; unset: torch's default."""
        value = os.environ.get("TRAINKIT_DIST_TIMEOUT", "").strip()
        if not value:
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ConfigError([problem(f"TRAINKIT_DIST_TIMEOUT={value!r} is not a positive number of seconds",
                                       "the environment variable TRAINKIT_DIST_TIMEOUT",
                                       "set it to e.g. 600, or unset it for torch's default")])
        return seconds


# --- DeepSpeed JSON: one source of truth --------------------------------------------------------------------------

def deepspeed_json(launch: Launch, cfg: TrainConfig, sources: dict[str, str]) -> tuple[dict, list[str]]:
    """The DeepSpeed JSON with every "auto" the run knows filled in, and the problems found.

    An explicit JSON value that disagrees with the run is an error naming both sources: silently preferring one of
    them is the field's most reported DeepSpeed pain. Clipping is always written explicitly: DeepSpeed's own
    default (1.0) would silently differ from the other strategies (PITFALLS).
    """
    path = launch.deepspeed_config
    where = f"{path} (deepspeed_config_file in {launch.source})"
    if launch.deepspeed_inline or not path:
        return {}, [problem("DeepSpeed settings are given in the Accelerate YAML, not in a JSON", launch.source,
                            "point deepspeed_config.deepspeed_config_file at a file in ds_configs/")]
    try:
        ds = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}, [problem(f"DeepSpeed config {path} does not exist", launch.source,
                            "run from the repository root or give deepspeed_config_file an absolute path")]
    except json.JSONDecodeError as e:
        return {}, [problem(f"{path} is not valid JSON: {e}", launch.source, "fix the file")]
    problems = []
    run_values = {
        "train_micro_batch_size_per_gpu": (cfg.batch_size, sources.get("batch_size", "recipe default")),
        "gradient_accumulation_steps": (cfg.grad_accum, sources.get("grad_accum", "recipe default")),
        "train_batch_size": (cfg.batch_size * cfg.grad_accum * launch.world_size,
                             "batch_size x grad_accum x num_processes"),
        "gradient_clipping": (float(cfg.max_grad_norm), sources.get("max_grad_norm", "recipe default")),
    }
    for key, (value, source) in run_values.items():
        given = ds.get(key, "auto")
        if given != "auto" and given != value:
            problems.append(problem(f"{key} is {given} in {path} but {value} in the run ({source})", where,
                                    f'set "{key}": "auto" in the JSON so the run fills it, or change {source}'))
        ds[key] = value
    for name in ("bf16", "fp16"):
        section = ds.setdefault(name, {})
        wanted = launch.mixed_precision == name
        given = section.get("enabled", "auto")
        if given != "auto" and bool(given) != wanted:
            problems.append(problem(f"{name}.enabled is {given} in {path} but mixed_precision is "
                                    f"{launch.mixed_precision} ({launch.source})", where,
                                    f'set "{name}": {{"enabled": "auto"}} in the JSON'))
        section["enabled"] = wanted
    for section in ("optimizer", "scheduler"):
        if section in ds:
            problems.append(problem(f"{path} defines an {section}, and so does the recipe", where,
                                    f'remove "{section}" from the JSON: the recipe\'s {section} is used under '
                                    f"every strategy"))
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage")
    if stage not in (0, 1, 2, 3):
        problems.append(problem(f"zero_optimization.stage must be 0-3, got {stage!r}", where,
                                'write the stage explicitly, e.g. "stage": 2'))
    if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        problems.append(problem("ZeRO-3 without stage3_gather_16bit_weights_on_model_save cannot write final/ "
                                "(it would fail after training)", where,
                                'set "stage3_gather_16bit_weights_on_model_save": true in zero_optimization'))
    offload_param = zero.get("offload_param", {}).get("device", "none")
    if offload_param not in ("none", None) and stage != 3:
        problems.append(problem(f"offload_param needs ZeRO stage 3, the JSON has stage {stage}", where,
                                "use ds_configs/zero3_offload.json, or remove offload_param"))
    offload_opt = zero.get("offload_optimizer", {}).get("device", "none")
    if offload_opt not in ("none", None) and stage not in (1, 2, 3):
        problems.append(problem(f"offload_optimizer needs ZeRO stage 1-3, the JSON has stage {stage}", where,
                                "use ds_configs/zero2_offload.json"))
    if not problems:
        problems += validate_with_deepspeed(ds, where)
    return ds, problems


def zero_stage(ds: dict) -> int | None:
    return ds.get("zero_optimization", {}).get("stage") if ds else None


def offloads_optimizer(ds: dict) -> bool:
    return ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") not in ("none", None)


def hidden_size(model: torch.nn.Module) -> int:
    """The model's hidden size for DeepSpeed's bucket formulas: `model.config.hidden_size` as Accelerate takes it
    (Accelerate raises for models without a config, the MLP); otherwise the square root of the largest parameter
    (the width of a square weight matrix)."""
    return getattr(getattr(model, "config", None), "hidden_size", None) or \
        int(math.sqrt(max(p.numel() for p in model.parameters())))


def persistence_threshold(hidden: int) -> int:
    """ZeRO-3 keeps parameters smaller than this whole on every rank (Accelerate's formula)."""
    return 10 * hidden


def fill_bucket_sizes(ds: dict, model: torch.nn.Module) -> None:
    """Replace "auto" bucket sizes with Accelerate's formulas, from the model's hidden size."""
    hidden = hidden_size(model)
    derived = {"reduce_bucket_size": hidden * hidden, "allgather_bucket_size": hidden * hidden,
               "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
               "stage3_param_persistence_threshold": persistence_threshold(hidden)}
    zero = ds.get("zero_optimization", {})
    for key, value in derived.items():
        if zero.get(key) == "auto":
            zero[key] = value


def validate_with_deepspeed(ds: dict, where: str) -> list[str]:
    """DeepSpeed's own schema check (unknown keys, wrong types), on a copy whose "auto" values are placeholders."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to stdout; --dry_run's stdout is JSON
        from deepspeed.runtime.config import DeepSpeedConfig

    probe = json.loads(json.dumps(ds))
    probe.pop("train_batch_size", None)  # DeepSpeed checks it against its own world size, which is 1 here
    for key, value in probe.get("zero_optimization", {}).items():
        if value == "auto":
            probe["zero_optimization"][key] = 1
    try:
        DeepSpeedConfig(probe)
    except Exception as e:  # pydantic's ValidationError or DeepSpeed's assertions: their words, one line
        first = " ".join(str(e).split())[:300]
        return [problem(f"DeepSpeed rejects the JSON: {first}", where, "fix the key it names (ds_configs/README.md)")]
    return []


def check_yaml(path: str) -> list[str]:
    """Unknown keys or values in an Accelerate YAML (--dry_run): Accelerate itself ignores or rejects them late."""
    import dataclasses
    import difflib

    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    data = yaml.safe_load(Path(path).read_text()) or {}
    where = f"--accelerate_config {path}"
    known = {f.name for f in dataclasses.fields(ClusterConfig)}
    problems = []
    for key in sorted(set(data) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        problems.append(problem(f"unknown key {key!r} in {path}", where,
                                f"did you mean {close[0]}?" if close else "remove it"))
    types = {t.value for t in DistributedType}
    if str(data.get("distributed_type", "NO")) not in types:
        problems.append(problem(f"distributed_type {data.get('distributed_type')!r} is not one of Accelerate's",
                                where, f"use one of {', '.join(sorted(KINDS))}"))
    for key in ("num_processes", "num_machines"):
        if key in data and (not isinstance(data[key], int) or data[key] < 1):
            problems.append(problem(f"{key} must be a positive integer, got {data[key]!r}", where,
                                    f"write {key}: 2"))
    ds = data.get("deepspeed_config") or {}
    if ds.get("deepspeed_config_file"):
        inline = sorted(set(ds) - {"deepspeed_config_file", "zero3_init_flag", "deepspeed_hostfile",
                                   "deepspeed_multinode_launcher", "deepspeed_exclusion_filter",
                                   "deepspeed_inclusion_filter"})
        if inline:
            problems.append(problem(f"deepspeed_config sets {', '.join(inline)} next to a deepspeed_config_file",
                                    where, "set them in the JSON (the recipe fills accumulation and clipping)"))
    return problems


# --- before anything is built --------------------------------------------------------------------------------------

def check_launch(launch: Launch, cfg: TrainConfig, sources: dict[str, str]) -> tuple[list[str], dict]:
    """Problems with this launch on this machine (all of them), and the resolved DeepSpeed JSON if any."""
    problems = []
    on_gpu = torch.cuda.is_available()
    where = f"mixed_precision from {launch.source}"
    if launch.mixed_precision not in PRECISIONS:
        problems.append(problem(f"unknown precision {launch.mixed_precision!r}", where,
                                f"use one of {', '.join(PRECISIONS)}"))
    if launch.mixed_precision == "fp16" and not on_gpu:
        # Accelerate gives fp16 on CPU neither autocast nor a loss scaler (silently fp32), and DeepSpeed fails with
        # "Type fp16 is not supported on your device".
        problems.append(problem("fp16 needs a GPU; this machine has none", where,
                                "use --mixed_precision bf16 (or no) on CPU"))
    if launch.mixed_precision == "bf16" and on_gpu and not torch.cuda.is_bf16_supported(including_emulation=False):
        # Accelerate and DeepSpeed accept it (torch emulates bf16 there), and the run is many times slower than fp16.
        problems.append(problem(f"bf16 needs a GPU with bf16 arithmetic (Ampere or newer); "
                                f"{torch.cuda.get_device_name()} only emulates it, many times slower", where,
                                "use --mixed_precision fp16 on this GPU"))
    if on_gpu and launch.world_size > torch.cuda.device_count() * launch.num_machines:
        problems.append(problem(f"{launch.world_size} processes but {torch.cuda.device_count()} GPU(s) per machine",
                                f"num_processes from {launch.source}", "pass --num_processes <= the GPU count"))
    ds: dict = {}
    if launch.kind == "deepspeed":
        ds, ds_problems = deepspeed_json(launch, cfg, sources)
        problems += ds_problems
        if ds and offloads_optimizer(ds) and cfg.optimizer != "adamw":
            problems.append(problem(f"optimizer {cfg.optimizer} cannot run in DeepSpeed's CPU offload (cpu_adam is "
                                    f"Adam only)", f"{launch.deepspeed_config}", "use --optimizer adamw"))
    if launch.kind == "fsdp" and launch.fsdp_version != 2:
        problems.append(problem(f"fsdp_version {launch.fsdp_version}: this runner shards with FSDP2 only",
                                f"fsdp_config in {launch.source}", "set fsdp_version: 2"))
    return problems, ds


# --- the Accelerator ------------------------------------------------------------------------------------------------

def build_accelerator(launch: Launch, cfg: TrainConfig, ds: dict, output_dir: Path, report_to: list[str]):
    """An Accelerator that does what `launch` asked for on this machine, verified before it is returned."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {}
    handlers = []
    init_kwargs: dict[str, Any] = {}  # one InitProcessGroupKwargs: Accelerate takes a single handler of each type
    if launch.kind == "deepspeed":
        # Accelerate refuses a YAML mixed_precision next to a DeepSpeed JSON, because its plugin would ignore one of
        # them. Here the YAML is the one source of precision and the JSON's "auto" was filled from it (a JSON that
        # disagrees was refused in deepspeed_json), so the two cannot differ.
        fields = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(f for f in fields if f != "mixed_precision")
        # Given explicitly so that nothing from the environment overrides the resolved JSON.
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds, gradient_accumulation_steps=cfg.grad_accum,
                                                     gradient_clipping=float(cfg.max_grad_norm))
        if not on_gpu and launch.world_size > 1:
            # Without a backend DeepSpeed forms a world of 2 while Accelerate sees 1 process (data not sharded);
            # with cpu=True Accelerate would silently train plain DDP instead (PITFALLS). Only with a real world:
            # a one-process gloo group breaks reduce/gather.
            init_kwargs["backend"] = "gloo"
    else:
        # A MULTI_GPU launch on a machine without GPUs becomes MULTI_CPU over gloo only when the script asks for
        # the CPU; otherwise every process runs alone as DistributedType.NO (PITFALLS: unsynchronised copies).
        kwargs["cpu"] = not on_gpu
    if launch.kind == "fsdp":
        # Accelerate applies FSDP only to GPU-type devices, so the runner applies FSDP2's fully_shard itself on every
        # device (one code path, tested on CPU); Accelerate must then not wrap the model again.
        os.environ["ACCELERATE_USE_FSDP"] = "false"
    if launch.dist_timeout_s and launch.world_size > 1:
        # How long a collective waits for the other ranks (TRAINKIT_DIST_TIMEOUT): a machine that vanishes without
        # closing its connections then fails the run after this, not after torch's 30 min (gloo) / 10 min (NCCL).
        init_kwargs["timeout"] = timedelta(seconds=launch.dist_timeout_s)
    if init_kwargs:
        handlers.append(InitProcessGroupKwargs(**init_kwargs))
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.grad_accum,
        # The schedule is defined in optimizer steps; a prepared scheduler otherwise steps once per process.
        step_scheduler_with_optimizer=False,
        log_with=report_to or None,
        project_dir=str(output_dir),
        kwargs_handlers=handlers,
        **kwargs,
    )
    verify_accelerator(launch, accelerator)
    return accelerator


def expected_distributed_type(launch: Launch) -> str:
    on_gpu = torch.cuda.is_available()
    if launch.kind == "single":
        return "NO"
    if launch.kind == "deepspeed":
        return "DEEPSPEED"
    return "MULTI_GPU" if on_gpu else "MULTI_CPU"  # ddp, and fsdp (sharded by the runner)


def verify_accelerator(launch: Launch, accelerator) -> None:
    """Refuse to train unless Accelerate does what the launch asked: N unsynchronised copies is the worst failure."""
    expected = expected_distributed_type(launch)
    actual = accelerator.distributed_type.value
    problems = []
    if actual != expected:
        problems.append(problem(f"Accelerate runs as {actual}, but the launch asked for {launch.kind} "
                                f"({expected} on this machine)", launch.source,
                                "build the Accelerator with trainkit.strategy.build_accelerator"))
    if accelerator.num_processes != launch.world_size:
        problems.append(problem(f"Accelerate sees {accelerator.num_processes} process(es) but the launcher started "
                                f"{launch.world_size}: each would train alone on all the data", launch.source,
                                "build the Accelerator with trainkit.strategy.build_accelerator"))
    if accelerator.mixed_precision != launch.mixed_precision:
        problems.append(problem(f"Accelerate uses precision {accelerator.mixed_precision}, the launch asked for "
                                f"{launch.mixed_precision}", launch.source, "check mixed_precision in the YAML"))
    if problems:
        raise ConfigError(problems)


# --- the model under a strategy --------------------------------------------------------------------------------------

class Strategy:
    """Prepares model, optimizer and scheduler for the launch, and answers what the loop asks of them."""

    def __init__(self, launch: Launch, accelerator, ds: dict):
        self.launch = launch
        self.accelerator = accelerator
        self.ds = ds
        self.notes: list[str] = []

    @property
    def zero_stage(self) -> int | None:
        return zero_stage(self.ds)

    def build_optimizer(self, cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
        from trainkit.optim import build_optimizer

        if self.ds and offloads_optimizer(self.ds):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            if self.accelerator.is_main_process:
                print("note: ZeRO-Offload runs Adam in DeepSpeed's cpu_adam op; its first use compiles it "
                      "(about a minute), later runs reuse ~/.cache/torch_extensions", flush=True)
            return build_optimizer(cfg, model, adam_class=DeepSpeedCPUAdam)
        return build_optimizer(cfg, model)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Strategy-specific changes before Accelerate sees the model."""
        if self.ds:
            fill_bucket_sizes(self.accelerator.state.deepspeed_plugin.deepspeed_config, model)
        if self.launch.kind == "fsdp":
            return self._fully_shard(model)
        has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        if has_batchnorm and self.launch.world_size > 1:
            if self.accelerator.device.type == "cpu":
                # torch's SyncBatchNorm raises on CPU tensors ("expected input tensor to be on GPU"): keep BN local.
                self.notes.append("BatchNorm stays per-rank: torch's SyncBatchNorm supports only GPU/XPU devices, "
                                  "so on CPU each rank normalises with its own micro-batch statistics (losses will "
                                  "differ from one process)")
            else:
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
                self.notes.append("BatchNorm converted to SyncBatchNorm")
        return model

    def _fully_shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2: shard each block (the transformer's layers, the MLP's Linear layers), then the root."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # No model.to(device) first: each fully_shard call moves only its own unit to the device, then shards it, so a
        # GPU never holds the whole unsharded model (the model FSDP exists for may not fit there).
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        precision = self.launch.mixed_precision
        policy = dict(
            # Mixed precision FSDP's way: compute in low precision, reduce gradients and keep the shards in fp32.
            mp_policy=MixedPrecisionPolicy(param_dtype=dtypes.get(precision), reduce_dtype=torch.float32),
            offload_policy=(CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.launch.fsdp_offload
                            else OffloadPolicy()),
            reshard_after_forward=self.launch.fsdp_reshard_after_forward,
        )
        block_names = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            is_block = type(module).__name__ in block_names if block_names else isinstance(module, torch.nn.Linear)
            if is_block and module is not model:
                fully_shard(module, **policy)
        fully_shard(model, **policy)
        unsharded = [name for name, p in model.named_parameters() if not _is_sharded(p, self.launch.world_size)]
        if unsharded:
            raise ConfigError([problem(f"FSDP left parameters unsharded: {', '.join(unsharded[:5])}", "fsdp",
                                       "report this with the recipe; use deepspeed_zero3.yaml meanwhile")])
        return model

    def prepare(self, model, optimizer, scheduler):
        if self.launch.kind == "fsdp":  # already sharded: Accelerate would add a DDP wrapper around it
            optimizer, scheduler = self.accelerator.prepare(optimizer, scheduler)
            return model, optimizer, scheduler
        return self.accelerator.prepare(model, optimizer, scheduler)

    def cast_batch(self, batch: Any, model: torch.nn.Module) -> Any:
        """Move a batch to the device; under DeepSpeed bf16/fp16 the weights themselves are low precision, so float
        inputs must be cast too ("mat1 and mat2 must have the same dtype" otherwise)."""
        from accelerate.utils import send_to_device

        batch = send_to_device(batch, self.accelerator.device)
        if not self.ds or self.launch.mixed_precision == "no":
            return batch
        dtype = torch.bfloat16 if self.launch.mixed_precision == "bf16" else torch.float16
        if isinstance(batch, dict):
            return {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in batch.items()}
        return [t.to(dtype) if torch.is_floating_point(t) else t for t in batch]

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float | None:
        """Clip to max_norm (0: no clipping) and return the total norm before clipping.

        DeepSpeed clips inside its step with the JSON's gradient_clipping (filled from the same max_norm); the norm
        is read back from the engine: None when the JSON turns its computation off (compute_grad_norm: false).
        """
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm or math.inf)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm) if norm is not None else None

    def step_was_skipped(self) -> bool:
        """fp16's loss scaler skips steps that overflowed; a normal event, counted in metrics."""
        if self.ds:
            engine = self.accelerator.deepspeed_engine_wrapped.engine
            return bool(getattr(engine.optimizer, "overflow", False))
        return self.accelerator.optimizer_step_was_skipped

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The consolidated weights on the main process (a collective: call on every rank)."""
        if self.launch.kind == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.accelerator.get_state_dict(model)


def end_process(code: int) -> NoReturn:
    """Exit with `code`; a rank started by a launcher skips interpreter finalization.

    destroy_process_group does not free torch 2.13's gloo groups while anything still holds them (ZeRO-3 tags every
    parameter with its group), so their worker threads live until finalization, where dropping the tensors they hold
    races the interpreter's teardown: a finished rank aborts with "terminate called without an active exception"
    and the launcher reports the run failed (1 of 68 ZeRO-3 runs here, and in CI; pytorch/pytorch#190489, open).
    Everything else that a normal exit does still happens: the atexit handlers run, the streams are flushed.
    """
    if "LOCAL_RANK" not in os.environ:
        sys.exit(code)
    atexit._run_exitfuncs()  # logging.shutdown and every library's own handlers, while the interpreter is whole
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _is_sharded(param: torch.Tensor, world_size: int) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(param, DTensor) and param.device_mesh.size() == world_size
            and all(isinstance(p, Shard) for p in param.placements))


# --- several machines: the hostfile pre-flight (--dry_run) ---------------------------------------------------------

def check_hosts(launch: Launch, timeout_s: float = 5.0) -> list[str]:
    """Problems with a DeepSpeed hostfile launch, found before anything starts: every one, each naming its host.

    Reads the hostfile as DeepSpeed does (`NAME slots=N`, # comments), applies the YAML's inclusion / exclusion
    filter, and checks what Accelerate will ask DeepSpeed for: without a filter every host runs
    num_processes / num_machines ranks, with one exactly the selected slots; either way num_processes ranks on
    num_machines hosts. Then every host must answer `ssh -o BatchMode=yes -o ConnectTimeout=...` (plus
    $PDSH_SSH_ARGS_APPEND, which pdsh will add too) within timeout_s, all hosts at once.
    """
    import shlex
    import shutil
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    if not launch.hostfile:
        return []
    path = Path(launch.hostfile)
    where = f"deepspeed_hostfile {path} in {launch.source}"
    if launch.num_machines < 2:
        return [problem(f"a hostfile is given but num_machines is {launch.num_machines}: Accelerate then ignores "
                        f"the hostfile and runs on this machine only", launch.source,
                        "set num_machines to the number of hosts, or remove deepspeed_hostfile")]
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        return [problem(f"cannot read the hostfile {path}: {e.strerror}", where,
                        "create it (see ./hostfile) or point deepspeed_hostfile at it; relative paths start from "
                        "the directory you launch from")]
    problems: list[str] = []
    slots: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        fields = text.split()
        if len(fields) < 2 or not fields[1].startswith("slots=") or not fields[1][6:].isdigit():
            problems.append(problem(f"line {number} of {path} is not `HOSTNAME slots=N`: {text!r}", where,
                                    "write one `HOSTNAME slots=N` per machine"))
        elif fields[0] in slots:
            problems.append(problem(f"host {fields[0]} is listed twice in {path}, again on line {number}", where,
                                    "list each host once, with all its slots"))
        else:
            slots[fields[0]] = int(fields[1][6:])
    if not slots and not problems:
        problems.append(problem(f"{path} lists no hosts", where, "add one `HOSTNAME slots=N` line per machine"))
    if problems:
        return problems

    # The hosts and slots the launch will use (DeepSpeed's include/exclude syntax: NAME[:SLOT,...][@NAME...]).
    used = {host: list(range(n)) for host, n in slots.items()}
    spec, include = (launch.hostfile_include, True) if launch.hostfile_include else (launch.hostfile_exclude, False)
    if launch.hostfile_include and launch.hostfile_exclude:
        return [problem("both deepspeed_inclusion_filter and deepspeed_exclusion_filter are set", launch.source,
                        "keep one of them")]
    if spec:
        chosen: dict[str, list[int]] = {}
        for node in spec.split("@"):
            host, _, slot_list = node.partition(":")
            if host not in slots:
                problems.append(problem(f"host {host} in the {'inclusion' if include else 'exclusion'} filter is not "
                                        f"in {path}", launch.source, f"use one of {', '.join(slots)}"))
                continue
            wanted = [int(s) for s in slot_list.split(",") if s.strip().isdigit()] if slot_list else used[host]
            missing = [s for s in wanted if s >= slots[host]]
            if missing:
                problems.append(problem(f"host {host} has {slots[host]} slot(s), the filter names slot(s) "
                                        f"{', '.join(map(str, missing))}", launch.source,
                                        f"use slots 0..{slots[host] - 1}"))
            chosen[host] = sorted(set(chosen.get(host, []) + wanted))
        if include:
            used = {h: chosen[h] for h in slots if h in chosen}
        else:
            used = {h: [s for s in used[h] if s not in chosen.get(h, [])] for h in slots}
            used = {h: s for h, s in used.items() if s}
        total = sum(len(s) for s in used.values())
        if not problems and (total != launch.world_size or len(used) != launch.num_machines):
            problems.append(problem(f"the filtered hostfile gives {total} slot(s) on {len(used)} host(s), the launch "
                                    f"asks for num_processes {launch.world_size} on num_machines "
                                    f"{launch.num_machines}", where,
                                    "change the filter, or num_processes / num_machines to match it"))
    else:
        per_host = launch.world_size // launch.num_machines
        if launch.world_size % launch.num_machines:
            problems.append(problem(f"num_processes {launch.world_size} does not divide into num_machines "
                                    f"{launch.num_machines}", launch.source,
                                    "make num_processes a multiple of num_machines: it is the total over all hosts"))
        if len(slots) != launch.num_machines:
            problems.append(problem(f"{path} lists {len(slots)} host(s) but num_machines is {launch.num_machines} "
                                    f"(without a filter DeepSpeed starts ranks on every host of the file)", where,
                                    "list exactly num_machines hosts, or select some with "
                                    "deepspeed_inclusion_filter"))
        for host, n in slots.items():
            if n < per_host:
                problems.append(problem(f"host {host} has {n} slot(s) but each machine runs num_processes / "
                                        f"num_machines = {per_host} process(es); the slots add up to "
                                        f"{sum(slots.values())}, num_processes is {launch.world_size}", where,
                                        f"give {host} slots={per_host} or more, or lower num_processes"))
    if problems:
        return problems

    if launch.multinode_launcher == "pdsh" and not shutil.which("pdsh"):
        problems.append(problem("pdsh is not installed on this machine", launch.source,
                                "install it (apt-get install pdsh) or choose another deepspeed_multinode_launcher"))
    if not shutil.which("ssh"):
        return problems + [problem("no ssh client on this machine", launch.source, "install openssh-client")]
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

    with ThreadPoolExecutor(max_workers=min(32, len(used))) as pool:
        for host, failure in zip(used, pool.map(answer, used)):
            if failure:
                problems.append(problem(f"host {host} does not answer over ssh: {failure}", where,
                                        f"make `ssh {host} true` work without a password from this machine "
                                        f"(ssh-copy-id {host}), check that it resolves and runs sshd, or remove it "
                                        f"from {path}"))
    return problems


# What a collective raises when another rank is gone: gloo (a plain RuntimeError) and NCCL / the store (DistError).
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
              "NCCL communicator was aborted", "Socket Timeout")


def lost_contact(error: BaseException) -> str | None:
    """Why a collective failed when the cause is another rank that died, froze or lost its network, else None.

    gloo's message starts with its source file ("[.../pair.cc:537] Read error [IP]:PORT: Connection reset by peer.
    This is typically caused by ..."): the part that says what happened is kept.
    """
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not (isinstance(error, torch.distributed.DistError) or any(s in text for s in _LOST_PEER)):
        return None
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
