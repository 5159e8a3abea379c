"""The one device mesh: how many ways each parallelism splits the processes, as torchtitan's ParallelDims.

Every launch that torch.distributed parallelises (not DeepSpeed, whose engine owns its own groups) is a point in
(pp, dp_replicate, dp_shard, cp, tp), outermost first:

    pp            pipeline stages (--pipeline_stages): each holds a contiguous range of the model's layers
    dp_replicate  copies of the model (DDP's replicas; HSDP's groups), each training on other samples
    dp_shard      processes that shard every parameter between them (FSDP2), each training on other samples
    cp            processes that split each sequence between them (torch's context parallelism), same samples;
                  FSDP2 shards over dp_shard x cp, as torchtitan does
    tp            processes that cut each planned Linear layer between them (tensor parallelism), same samples

Expert parallelism (ep) is not a dimension of its own: as torchtitan does, it regroups the data-parallel shards, ep
neighbouring ranks of dp_shard splitting each mixture-of-experts layer's experts between them while every rank still
trains on its own samples (strategies/expert_parallel.py builds the experts' mesh: expert_mesh).

Their product is the world size. Rank r sits at the coordinates of r in that row-major order: the ranks of one
tensor-parallel group are neighbours (one machine, fast links), the pipeline is outermost (its point-to-point sends
cross machines cheaply; Megatron-LM and torchtitan order them the same way). The sizes come from the launch: an FSDP
YAML's `parallelism_config` (its tp, cp, dp_shard and dp_replicate), `--pipeline_stages`, and whatever is left of the
world: the data-parallel dimension of the launch type (dp_shard for FSDP, dp_replicate for DDP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from trainkit.errors import Problem
from trainkit.launch.launcher import PARALLELISM_KEY, Launch


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """The sizes of the mesh's dimensions, one field each; `names` orders them, outermost first. A new dimension is
    a field, its place in `names`, and its application step (docs/strategies.md#adding-a-strategy)."""

    names: ClassVar[tuple[str, ...]] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # ranks of dp_shard that split the experts (not in names: it does not multiply the world)

    @classmethod
    def of(cls, launch: Launch, pipeline_stages: int = 1) -> ParallelDims:
        """The launch's sizes: a parallelism_config's as written (their product times the stages must be the world:
        problems() says so), else the processes the stages leave, on the launch's data-parallel dimension."""
        pp = max(1, pipeline_stages)
        if launch.parallelism:
            return cls(pp=pp, **{name: launch.parallelism_size(name) for name in (*cls.names, "ep") if name != "pp"})
        rest = max(1, launch.world_size // pp)
        return cls(pp, dp_shard=rest) if launch.distributed_type == "FSDP" else cls(pp, dp_replicate=rest)

    def sizes(self) -> dict[str, int]:
        """Each dimension's size, outermost first."""
        return {name: getattr(self, name) for name in self.names}

    @property
    def world(self) -> int:
        return math.prod(self.sizes().values())

    @property
    def data_parallel(self) -> int:
        """The ranks that compute different samples: the global batch is batch_size x grad_accum x this."""
        return self.dp_replicate * self.dp_shard

    def fsdp_label(self, offload: bool = False) -> str:
        """An FSDP launch's name for these sizes: fsdp, hsdp, tp, fsdp_tp, hsdp_tp, fsdp_cp or fsdp_ep (fsdp.yaml on
        one process: still fsdp), with _offload when the shards live in CPU memory."""
        data = "hsdp" if self.dp_replicate > 1 else "fsdp" if self.dp_shard * self.cp > 1 or self.tp == 1 else ""
        parts = (data, "cp" if self.cp > 1 else "", "tp" if self.tp > 1 else "", "ep" if self.ep > 1 else "")
        return "_".join(part for part in parts if part) + ("_offload" if offload else "")

    def resized(self, world_size: int) -> ParallelDims:
        """These sizes for another number of processes (--estimate --num_processes N): the outermost data-parallel
        dimension in use takes what the others leave, as adding machines would grow it."""
        model = self.world // self.data_parallel  # the ranks that split one model (every other dimension)
        if self.dp_replicate > 1 or self.dp_shard == 1 and self.tp == 1:
            return replace(self, dp_replicate=max(1, world_size // (model * self.dp_shard)))
        if self.dp_shard > 1:
            return replace(self, dp_shard=max(1, world_size // model))
        return replace(self, tp=max(1, world_size * self.tp // model))

    def problems(self, launch: Launch) -> list[Problem]:
        """Sizes that do not multiply to the processes launched (parallelism_config's keys in the fix)."""
        if self.world == launch.world_size:
            return []
        shown = [name for name, size in self.sizes().items() if name not in ("pp", "cp") or size > 1]  # optional ones
        named = " x ".join(f"{name} {getattr(self, name)}" for name in shown)
        keys = " x ".join(PARALLELISM_KEY.format(name) for name in shown if name != "pp")
        where = f"parallelism_config in {launch.source}" if launch.parallelism else f"--pipeline_stages {self.pp}"
        stages = "--pipeline_stages x " if self.pp > 1 else ""
        fix = (f"make {stages}{keys} equal num_processes (accelerate launch --num_processes must match it too)"
               if launch.parallelism else f"launch a multiple of {self.pp} processes (--num_processes {self.pp}), or "
               f"change --pipeline_stages")
        return [Problem(f"the parallelism sizes multiply to {self.world} ({named}) but {launch.world_size} process(es) "
                        f"were launched", where, fix)]

    def build(self, device_type: str) -> Any:
        """The DeviceMesh over every process (once the process group exists)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(self.sizes().values()), mesh_dim_names=self.names)


def data_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The sub-mesh FSDP2 shards over: (dp_replicate, dp_shard) for HSDP (replicas of shards), else dp_shard; with
    context parallelism dp_shard x cp flattened into one dimension (the ranks that split a sequence hold a part of
    every parameter too, and their gradients are summed with the others')."""
    if dims.cp > 1:  # torchtitan's flattened dimension (context parallelism runs without dp_replicate: mesh.py)
        return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 and dims.dp_shard > 1 else mesh["dp_shard"]


def data_parallel_rank(mesh: Any, dims: ParallelDims) -> int:
    """Which part of each global batch this rank computes: its (dp_replicate, dp_shard) coordinate, row-major."""
    return mesh.get_local_rank("dp_replicate") * dims.dp_shard + mesh.get_local_rank("dp_shard")


def parallelism_problems(launch: Launch) -> list[Problem]:
    """What the runner refuses in a YAML's parallelism_config besides its product (ParallelDims.problems): sizes
    below 1, the dimension it does not apply (sequence parallelism: DeepSpeed's), replicas without shards."""
    where = f"parallelism_config in {launch.source}"
    problems = [Problem(f"{PARALLELISM_KEY.format(name)} is {size}: every size must be a positive integer", where,
                        f"set {PARALLELISM_KEY.format(name)}: 1 or more")
                for name, size in launch.parallelism.items() if size < 1]
    if launch.parallelism_size("sp") > 1:
        problems.append(Problem(f"{PARALLELISM_KEY.format('sp')} is {launch.parallelism_size('sp')}: sequence "
                                f"parallelism runs under DeepSpeed (Accelerate's sp_backend: deepspeed)", where,
                                f"set {PARALLELISM_KEY.format('sp')}: 1, or start from "
                                f"accelerate_configs/deepspeed_zero3_sp.yaml"))
    replicas, shards = launch.parallelism_size("dp_replicate"), launch.parallelism_size("dp_shard")
    if replicas > 1 and shards == 1:
        # Accelerate's own rule: replicas without sharding are DDP (with tp as well, it asks for dp_shard instead)
        problems.append(Problem(f"dp_replicate {replicas} with dp_shard 1: replicas without sharding are data "
                                f"parallelism", where,
                                "use accelerate_configs/ddp.yaml for replicas only, or move the replicas to "
                                "parallelism_config_dp_shard_size (FSDP), or shard within them (hsdp.yaml)"))
    return problems
