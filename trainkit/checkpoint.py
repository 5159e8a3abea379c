"""Checkpoints you can trust: atomic saves, exact resume, resume under another strategy, and the final export.

A checkpoint is `checkpoints/step_<N>/`:

    trainer_state.json   step, data position, scheduler, loss scaler, resolved config (written last, by rank 0)
    rng/rank_<r>.pt      every rank's RNG states (torch, CUDA, Python, NumPy)
    state/               model + optimizer: torch.distributed.checkpoint (single, DDP, FSDP2: reshardable), or
    deepspeed/           DeepSpeed's own sharded checkpoint (ZeRO-1/2/3)

It is written as `step_<N>.tmp`; after every rank's part is on disk (a barrier) rank 0 renames it, then points
`checkpoints/latest` at it (write + rename), and only then prunes beyond --keep_last. A crash at any moment leaves
the previous checkpoint whole and `latest` naming a complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from trainkit.config import ConfigError, TrainConfig, config_dict, problem

DEEPSPEED_TAG = "deepspeed"


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        # NumPy's state holds an ndarray, which weights_only loading refuses: store it as a plain list.
        "numpy": (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True, slots=True)
class Found:
    """A complete checkpoint on disk and what it was saved under."""

    path: Path
    state: dict[str, Any]

    @property
    def format(self) -> str:
        return self.state["format"]


class Checkpointer:
    """Saves and restores training state under the run's strategy (see the module docstring for the layout)."""

    def __init__(self, accelerator, strategy, output_dir: Path, keep_last: int):
        self.accelerator = accelerator
        self.strategy = strategy
        self.root = output_dir / "checkpoints"
        self.keep_last = keep_last
        self._universal: Path | None = None  # set by reshard()

    @property
    def format(self) -> str:
        return "deepspeed" if self.strategy.ds else "dcp"

    # --- saving -----------------------------------------------------------------------------------------------------

    def save(self, step: int, model, optimizer, scheduler, position: tuple[int, int], skipped_steps: int,
             resolved: dict[str, Any]) -> Path:
        acc = self.accelerator
        final, tmp = self.root / f"step_{step}", self.root / f"step_{step}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # the remains of a save that was killed
            (tmp / "rng").mkdir(parents=True)
        acc.wait_for_everyone()
        torch.save(_rng_state(), tmp / "rng" / f"rank_{acc.process_index}.pt")
        if self.format == "deepspeed":
            model.save_checkpoint(str(tmp / "deepspeed"), tag=DEEPSPEED_TAG, save_latest=False)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(acc.unwrap_model(model), _raw(optimizer))
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "state"))
        acc.wait_for_everyone()  # every rank's part is on disk
        if acc.is_main_process:
            state = {
                "format": self.format, "step": step, "epoch": position[0], "batch_in_epoch": position[1],
                "skipped_steps": skipped_steps, "scheduler": scheduler.state_dict(),
                "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
                "strategy": resolved["strategy"], "world_size": resolved["world_size"],
                "zero_stage": resolved["zero_stage"], "resolved_config": resolved,
            }
            _write_atomically(tmp / "trainer_state.json", json.dumps(state, indent=2) + "\n")
            shutil.rmtree(final, ignore_errors=True)  # a re-run of this very step (after a resume)
            os.replace(tmp, final)
            _write_atomically(self.root / "latest", final.name + "\n")
            self._prune(step)
        acc.wait_for_everyone()
        return final

    def _prune(self, newest: int) -> None:
        if self.keep_last <= 0:
            return
        steps = sorted(int(p.name.removeprefix("step_")) for p in self.root.glob("step_*")
                       if p.name.removeprefix("step_").isdigit())
        for old in [s for s in steps if s <= newest][:-self.keep_last]:
            shutil.rmtree(self.root / f"step_{old}")

    # --- finding --------------------------------------------------------------------------------------------------------

    @staticmethod
    def find(output_dir: Path, resume: str) -> Found:
        """The checkpoint `--resume latest|PATH` names; refuses anything incomplete."""
        if resume == "latest":
            latest = output_dir / "checkpoints" / "latest"
            if not latest.exists():
                raise ConfigError([problem(f"no checkpoint to resume in {output_dir}", "--resume latest",
                                           "start without --resume, or pass --resume PATH to a checkpoint")])
            path = latest.parent / latest.read_text().strip()
        else:
            path = Path(resume)
        state_file = path / "trainer_state.json"
        if not state_file.is_file():
            raise ConfigError([problem(f"{path} is not a complete checkpoint (no trainer_state.json)",
                                       f"--resume {resume}", "pass a checkpoints/step_<N> folder, or latest")])
        return Found(path, json.loads(state_file.read_text()))

    # --- restoring ------------------------------------------------------------------------------------------------------

    def _same_layout(self, found: Found) -> bool:
        return (found.state["zero_stage"] == self.strategy.zero_stage
                and found.state["world_size"] == self.accelerator.num_processes)

    def exact(self, found: Found) -> bool:
        """Whether the saved model + optimizer state can be restored under this run's strategy, resharded if needed.

        torch.distributed.checkpoint reshards between single, DDP and FSDP2 at any world size. A DeepSpeed checkpoint
        restores natively under the same ZeRO stage and world size, and between ZeRO-1 and ZeRO-2 of any world size
        through DeepSpeed's universal checkpoint (see `reshard`). Measured here, universal checkpoints of ZeRO-3
        either fail to load (into ZeRO-2) or lose optimizer precision (1.4e-3 off after a step), so ZeRO-3 moves,
        like moves between the two formats, carry only the consolidated weights over (`warm_start`).
        """
        if found.format != self.format:
            return False
        if self.format == "deepspeed" and not self._same_layout(found):
            return found.state["zero_stage"] in (1, 2) and self.strategy.zero_stage in (1, 2)
        return True

    def reshard(self, found: Found) -> str | None:
        """Before `prepare`: convert a ZeRO-1/2 checkpoint saved under another world size or stage into DeepSpeed's
        universal format (main process, once, into output_dir/universal/), and tell the engine to load that
        format. Returns the note to print, or None when nothing had to change."""
        if self.format != "deepspeed" or not self.exact(found) or self._same_layout(found):
            return None
        target = self.root.parent / "universal" / found.path.name
        failed = target.with_name(target.name + ".failed")  # how the other ranks learn that rank 0's conversion failed
        if self.accelerator.is_main_process and not target.exists():
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            failed.unlink(missing_ok=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            convert = subprocess.run(
                [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                 str(found.path / "deepspeed" / DEEPSPEED_TAG), "--output_folder", str(tmp),
                 "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                capture_output=True, text=True)
            if convert.returncode == 0:
                tmp.rename(target)
            else:
                failed.write_text((convert.stderr.strip().splitlines() or ["?"])[-1])
        self.accelerator.wait_for_everyone()
        if failed.exists():
            raise ConfigError([problem(f"DeepSpeed could not convert {found.path} to a universal checkpoint: "
                                       f"{failed.read_text()}", "--resume",
                                       "resume under the ZeRO stage and process count it was saved with")])
        self.accelerator.state.deepspeed_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}
        self._universal = target
        return (f"resuming a ZeRO-{found.state['zero_stage']} checkpoint of {found.state['world_size']} process(es) "
                f"as ZeRO-{self.strategy.zero_stage} on {self.accelerator.num_processes}: converted to DeepSpeed's "
                f"universal checkpoint ({target}), optimizer state kept")

    def warm_start(self, found: Found, model: torch.nn.Module) -> str:
        """Load the checkpoint's consolidated weights into the not-yet-prepared model; returns the note to print."""
        if found.format == "deepspeed":
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            weights = get_fp32_state_dict_from_zero_checkpoint(str(found.path / "deepspeed"), tag=DEEPSPEED_TAG)
            model.load_state_dict(weights, strict=True)
        else:
            import torch.distributed.checkpoint as dcp

            weights = {"model": model.state_dict()}
            dcp.load(weights, checkpoint_id=str(found.path / "state"))
            model.load_state_dict(weights["model"], strict=True)
        saved = f"{found.state['strategy']} (ZeRO-{found.state['zero_stage']}) " if found.state["zero_stage"] \
            else f"{found.state['strategy']} "
        return (f"resuming a checkpoint saved under {saved}on {found.state['world_size']} process(es): weights "
                f"loaded, optimizer state starts fresh (this strategy cannot read that optimizer state)")

    def load(self, found: Found, model, optimizer, scheduler) -> None:
        """Restore model and optimizer (exact only), scheduler, loss scaler and this rank's RNG."""
        acc = self.accelerator
        if self.exact(found):
            if self.format == "deepspeed":
                universal = self._universal
                load_dir, tag = (universal.parent, universal.name) if universal else (found.path / "deepspeed",
                                                                                       DEEPSPEED_TAG)
                model.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                      load_lr_scheduler_states=False)
            else:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

                unwrapped, raw = acc.unwrap_model(model), _raw(optimizer)
                model_state, optim_state = get_state_dict(unwrapped, raw)
                state = {"model": model_state, "optim": optim_state}
                dcp.load(state, checkpoint_id=str(found.path / "state"))
                set_state_dict(unwrapped, raw, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(found.state["scheduler"])
        if acc.scaler is not None and found.state["scaler"]:
            acc.scaler.load_state_dict(found.state["scaler"])
        rng_file = found.path / "rng" / f"rank_{acc.process_index}.pt"
        if rng_file.exists():  # a rank the saved run did not have keeps its fresh seed
            _set_rng_state(torch.load(rng_file, weights_only=True))


def check_output_dir(output_dir: Path, resume: str | None, overwrite: bool, resolved: dict[str, Any],
                     ) -> tuple[list[str], Found | None]:
    """Problems with writing into output_dir, and the checkpoint to resume from.

    A new run never writes over an earlier one unless told --overwrite; a resumed run must keep the global batches
    (seed, global batch size) and the recipe of the run it continues, or its data order would silently change.
    """
    existing = [name for name in ("checkpoints", "metrics.jsonl", "final") if (output_dir / name).exists()]
    if resume is None:
        if existing and not overwrite:
            return [problem(f"{output_dir} already holds a run ({', '.join(existing)})", "--output_dir",
                            "pass --resume latest to continue it, --overwrite to replace it, or a new --output_dir")], None
        return [], None
    if overwrite:
        return [problem("--resume and --overwrite contradict each other", "command line", "pass only one")], None
    try:
        found = Checkpointer.find(output_dir, resume)
    except ConfigError as e:
        return e.problems, None
    saved = found.state["resolved_config"]
    problems = [problem(f"{key} is {resolved[key]} but the checkpoint was trained with {saved[key]}",
                        f"--resume {resume}", f"resume with the same {key}, or start a new run")
                for key in ("recipe", "seed", "global_batch_size") if saved[key] != resolved[key]]
    return problems, found


def clear_outputs(output_dir: Path) -> None:
    """Remove an earlier run's outputs (--overwrite): stale checkpoints would otherwise mix with the new ones."""
    for folder in ("checkpoints", "final", "train", "universal"):  # train/: TensorBoard's events
        shutil.rmtree(output_dir / folder, ignore_errors=True)
    for name in ("metrics.jsonl", "resolved_config.json"):
        (output_dir / name).unlink(missing_ok=True)


def _raw(optimizer):
    """The torch optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def export_final(accelerator, state_dict: dict, model, recipe: ModuleType, cfg: TrainConfig, cache_dir: Path,
                 output_dir: Path) -> Path:
    """Consolidated safetensors in output_dir/final, whatever the strategy; written by the main process only.

    `state_dict` is the gathered full state dict (Strategy.full_state_dict). The folder is written under a
    temporary name and renamed, so `final/` is never half-written.
    """
    final = output_dir / "final"
    if accelerator.is_main_process:
        tmp = output_dir / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        unwrapped = accelerator.unwrap_model(model)
        if hasattr(recipe, "export"):
            recipe.export(unwrapped, state_dict, cfg, cache_dir, tmp)
        else:
            # safetensors refuses tensors that share memory; contiguous copies are what a reload needs anyway.
            save_file({k: v.detach().contiguous().clone() for k, v in state_dict.items()},
                      str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config_dict(cfg), indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    accelerator.wait_for_everyone()
    return final
