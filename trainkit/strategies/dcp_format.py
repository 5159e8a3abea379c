"""A checkpoint format, the object that writes and reads the model and optimizer part of checkpoints/step_<N>/, and
the format of the torch engines (one process, DDP, the FSDP2 / tensor-parallel mesh, the pipeline):
torch.distributed.checkpoint, each rank writing its own shards, reshardable across world sizes and these strategies.

An engine names its format class (`Engine.format`); trainkit/run/checkpoint.py's Checkpointer makes the one instance
of a run and is the only caller. The step folder around it (trainer_state.json, every rank's RNG, the atomic rename)
is the Checkpointer's and the same for every format.

What it holds is what trains: the frozen parameters never change, and build_model makes them again in every launch
(from the seed or the pretrained weights), so they are left out (under LoRA a checkpoint holds the adapters and
their optimizer states); loading checks that every parameter that trains, and nothing else, came back.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from trainkit.models import quantised


class Checkpointed(Protocol):
    """What a format reads of its engine (strategies/engine.py's Engine, which imports this module for its
    `format`): the trained model and optimizer, and how a part's names map to the whole model's."""

    def checkpointed(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, list[str]] | None]: ...


class CheckpointFormat:
    """How one engine's trained state is written into, and read back from, a checkpoint's step folder."""

    name: ClassVar[str]  # trainer_state.json's "format": a resume compares it
    version: ClassVar[int] = 1  # trainer_state.json's "format_version": a layout changed under the same name
    older: ClassVar[tuple[str, ...]] = ()  # names this format had before, whose weights load_weights reads
    folder: ClassVar[str]  # the model + optimizer state's folder inside checkpoints/step_<N>/
    writes_async: ClassVar[bool] = False  # whether save() can return before the write ends (--async_save)

    def __init__(self, engine: Checkpointed, asynchronous: bool = False) -> None:
        if asynchronous and not self.writes_async:
            raise ValueError(f"the {self.name} format writes synchronously only")  # the plan refuses it before
        self.engine = engine  # prepared by the time save or load runs
        self.writer = Writer.make() if asynchronous else None

    def save(self, step_dir: Path) -> Future | None:
        """Write this rank's part of the trained state into the step folder; with a writer, only copy it and return
        the write's future (its result: every rank's part is on disk: trainkit/run/checkpoint.py's
        Checkpointer.poll)."""
        raise NotImplementedError

    def load(self, step_dir: Path) -> None:
        """Read this rank's part back, into the prepared model and optimizer."""
        raise NotImplementedError

    def resumes_exactly(self, saved: Mapping[str, Any]) -> bool:
        """Whether a checkpoint saved under `saved` (its trainer_state) restores model and optimizer here."""
        return saved["format"] == self.name and saved.get("format_version", 1) == self.version

    def before_resume(self, step_dir: Path, saved: Mapping[str, Any], output_dir: Path) -> str | None:
        """Before the engine prepares the model: anything the checkpoint needs converted; returns a note, or None."""
        return None

    @classmethod
    def load_weights(cls, model: torch.nn.Module, step_dir: Path) -> None:
        """The consolidated weights of a checkpoint in this format into an unprepared model (a warm start under a
        format that cannot read its optimizer state)."""
        raise NotImplementedError


class DCP(CheckpointFormat):
    """torch.distributed.checkpoint under the whole model's parameter names, the optimizer's state and settings per
    parameter (torch's flatten_optimizer_state_dict, as torchtitan keeps them): one process, DDP, FSDP2 / TP and the
    pipeline's stages at any world size and stage count read each other's, optimizer state included. A pipeline's
    stages are written under the whole model's names (Engine.checkpointed gives the map), tied weights under each."""

    name = "dcp"
    version = 2  # 1: the optimizer's state dict nested, the pipeline's as "dcp_pipeline" (weights only now)
    older = ("dcp_pipeline",)
    folder = "state"
    writes_async = True

    def save(self, step_dir: Path) -> Future | None:
        model, optimizer, names = self.engine.checkpointed()
        return _write(_plain_shards(_renamed(*trained_state(model, optimizer), names)), step_dir / self.folder,
                      self.writer)

    def load(self, step_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp

        model, optimizer, names = self.engine.checkpointed()
        model_state, optim_state = trained_state(model, optimizer)
        laid_out = _renamed(model_state, optim_state, names)
        state = _plain_shards(laid_out)
        dcp.load(state, checkpoint_id=str(step_dir / self.folder))
        state = {part: {key: _as_laid_out(value, laid_out[part][key]) for key, value in entries.items()}
                 for part, entries in state.items()}
        if names:  # back under the part's own names
            state = {"model": {name: state["model"][names[name][0]] for name in model_state},
                     "optim": {key: state["optim"][_per_parameter(key, names)] for key in optim_state}}
        restore_trained(model, optimizer, state["model"], state["optim"])

    @classmethod
    def load_weights(cls, model: torch.nn.Module, step_dir: Path) -> None:
        load_weights(model, step_dir / cls.folder)


class Writer:
    """torch.distributed.checkpoint's async_save on a process group of its own: the call copies the state into CPU
    memory (the loop's only wait) and a thread writes it. The group is gloo (async_save wants a CPU backend, also
    beside NCCL) and its own, so that the write's collectives never interleave with the training step's."""

    def __init__(self, group: Any) -> None:
        self.group = group  # None in one process without a process group

    @classmethod
    def make(cls) -> Writer:
        import torch.distributed as dist

        from trainkit.launch.rank_exit import keep_until_exit

        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        keep_until_exit(group)  # freed at exit, a gloo group can hang its rank (trainkit/launch/rank_exit.py)
        return cls(group)

    def write(self, state: dict, folder: Path) -> Future:
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(state, checkpoint_id=str(folder), process_group=self.group)


def _write(state: dict, folder: Path, writer: Writer | None) -> Future | None:
    if writer is not None:
        return writer.write(state, folder)
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder))
    return None


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """The weights of a checkpoint in `folder` into an unprepared model (a warm start under another strategy)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = {"model": _trained_only(get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True)))}
    dcp.load(weights, checkpoint_id=str(folder))
    load_trained_weights(model, weights["model"])


def _renamed(model_state: dict, optim_state: dict, names: dict[str, list[str]] | None) -> dict:
    """The state as written: a part of the model's (a pipeline's stages) under the whole model's names (`names`:
    each name in the part's state dict -> every name the tensor has in the whole model; None: the model is whole):
    every name of a weight (tied ones under both), the optimizer's entries under the first. Stages that share a
    weight write equal values under equal names, which torch.distributed.checkpoint writes once."""
    if not names:
        return {"model": model_state, "optim": optim_state}
    model = {alias: value for name, value in model_state.items() for alias in names[name]}
    return {"model": model, "optim": {_per_parameter(key, names): value for key, value in optim_state.items()}}


def _plain_shards(state: dict) -> dict:
    """The state with each strided shard (tensor parallelism's cut of fused experts' gate and up projections:
    strategies/tp_plan.py) laid out as a plain shard of the same tensor, which torch.distributed.checkpoint writes
    (it writes each rank's piece as one block of the whole tensor, and a strided piece is two: "overlapping
    chunks"); the checkpoint is then the same as under any other layout, and loads into any."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def plain(value: Any) -> Any:
        placements = getattr(value, "placements", ())
        if not any(isinstance(p, _StridedShard) for p in placements):
            return value
        return value.redistribute(value.device_mesh,
                                  [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements])

    return {part: {key: plain(value) for key, value in entries.items()} for part, entries in state.items()}


def _as_laid_out(value: Any, template: Any) -> Any:
    """A value read through _plain_shards back in its template's layout."""
    if value is template or getattr(value, "placements", None) == getattr(template, "placements", None):
        return value
    return value.redistribute(template.device_mesh, template.placements)


def _per_parameter(key: str, names: dict[str, list[str]]) -> str:
    """A flattened optimizer entry's key ("state.<name>.exp_avg", "param_groups.<name>.lr") under the whole model's
    first name for the parameter."""
    kind, rest = key.split(".", 1)
    name, field = rest.rsplit(".", 1)
    return f"{kind}.{names[name][0]}.{field}"


def trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts (torch.distributed.checkpoint's, sharded as the model is) without the
    frozen parameters, the optimizer's flattened: its state and settings keyed by parameter name, so that a layout
    with other parameter groups (another pipeline cut) reads them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(
        ignore_frozen_params=True, flatten_optimizer_state_dict=True))
    return _trained_only(model_state), optim_state


def _trained_only(model_state: dict) -> dict:
    """The model's state without a 4-bit base's quantisation constants, which a state dict holds beside the frozen
    weights but not as parameters (ignore_frozen_params keeps them)."""
    return {key: value for key, value in model_state.items() if not quantised.is_constant(key)}


def restore_trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optim_state: dict) -> None:
    """Load trained_state's dicts back: every parameter that trains, and nothing else, must be in them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    keys = set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                          options=StateDictOptions(ignore_frozen_params=True, strict=False,
                                                   flatten_optimizer_state_dict=True))
    _check_only_frozen_missing(model, keys)


def load_trained_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """A checkpoint's weights into an unprepared model: every parameter that trains; the frozen ones stay as
    build_model made them."""
    _check_only_frozen_missing(model, model.load_state_dict(weights, strict=False))


def _check_only_frozen_missing(model: torch.nn.Module, keys) -> None:
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    missing = [k for k in keys.missing_keys if k not in frozen and not quantised.is_constant(k)]
    if missing or keys.unexpected_keys:
        raise RuntimeError(f"the checkpoint does not fit the model: missing {missing[:5]}, unexpected "
                           f"{list(keys.unexpected_keys)[:5]}")
