"""DeepSpeed's own checkpoint format for trainkit/strategies/deepspeed.py's engine: the engine's save_checkpoint and
load_checkpoint under checkpoints/step_<N>/deepspeed/ (each rank its own shards), and DeepSpeed's universal format for a
checkpoint resumed under another process count (or, for ZeRO-1/2, the other of the two stages). The Checkpointer
(trainkit/run/checkpoint.py) is its only caller, as for dcp_format.py's torch format.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainkit.errors import ConfigError, Problem
from trainkit.strategies import deepspeed_ep
from trainkit.strategies.dcp_format import CheckpointFormat, load_trained_weights

TAG = "deepspeed"  # the one tag under checkpoints/step_<N>/deepspeed/


def _mend_zero3_universal_load(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """DeepSpeed's ZeRO-3 universal load (load_hp_checkpoint_state_from_checkpoint_dir_stage3 in
    deepspeed/runtime/zero/stage3.py) gives every parameter group's state one shared `step` tensor, which torch's
    AdamW then advances once per group each step, and every group the first group's settings (weight decay on the
    biases too). Measured on the MLP's two groups: the curve 1e-3 off a native resume within 6 steps. Each group gets
    its own step and its own settings back; lr comes from the checkpoint (the schedule goes on from it)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    for group, settings in zip(optimizer.param_groups, groups, strict=True):
        group.update(settings)


class DeepSpeedFormat(CheckpointFormat):
    """DeepSpeed's own checkpoint (the engine's save_checkpoint / load_checkpoint), with its universal format for a
    checkpoint resumed under another process count (or, for ZeRO-1/2, the other of the two stages)."""

    name = "deepspeed"
    folder = "deepspeed"

    def __init__(self, engine: Any, asynchronous: bool = False) -> None:  # deepspeed.py's ZeroEngine
        super().__init__(engine, asynchronous)
        self.universal: Path | None = None  # set by before_resume when a checkpoint was converted

    def save(self, step_dir: Path) -> None:
        # the frozen parameters stay out, as in dcp_format.trained_state: build_model makes them again
        self.engine.model.save_checkpoint(str(step_dir / self.folder), tag=TAG, save_latest=False,
                                          exclude_frozen_parameters=True)

    def load(self, step_dir: Path) -> None:
        load_dir, tag = ((self.universal.parent, self.universal.name) if self.universal
                         else (step_dir / self.folder, TAG))
        model = self.engine.model
        optimizer = model.optimizer.optimizer  # the torch optimizer inside DeepSpeed's ZeRO optimizer
        groups = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
        model.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False,
                              load_module_strict=all(p.requires_grad for p in model.parameters()))
        if self.universal and self.engine.strategy.stage == 3:
            _mend_zero3_universal_load(optimizer, groups)

    def _same_layout(self, saved: Mapping[str, Any]) -> bool:
        engine = self.engine
        return saved["zero_stage"] == engine.strategy.stage and saved["world_size"] == engine.launch.world_size \
            and deepspeed_ep.run_ep_size(saved["resolved_config"]) == engine.strategy.ep

    def resumes_exactly(self, saved: Mapping[str, Any]) -> bool:
        """Natively under the same ZeRO stage and world size; between ZeRO-1 and ZeRO-2 of any world size, and from
        ZeRO-3 to ZeRO-3 of another world size, through DeepSpeed's universal checkpoint (`before_resume`; ZeRO-3's
        load mended by _mend_zero3_universal_load). A ZeRO-3 universal checkpoint fails to load into ZeRO-2
        (measured), so moves between ZeRO-3 and ZeRO-1/2 carry only the consolidated weights over (a warm start). A
        checkpoint of DeepSpeed's AutoEP (each rank's own experts, in its layout) resumes natively only."""
        if not super().resumes_exactly(saved):
            return False
        if self.engine.strategy.ep > 1 or deepspeed_ep.run_ep_size(saved["resolved_config"]) > 1:
            return self._same_layout(saved)  # AutoEP's experts: natively only (resume_problems refuses the rest)
        return self._same_layout(saved) or (saved["zero_stage"] in (1, 2) and self.engine.strategy.stage in (1, 2)) \
            or saved["zero_stage"] == self.engine.strategy.stage == 3

    def before_resume(self, step_dir: Path, saved: Mapping[str, Any], output_dir: Path) -> str | None:
        """Convert a checkpoint of another world size (or ZeRO-1/2 stage) into DeepSpeed's universal format (main
        process, once, into output_dir/universal/), and tell the engine to load that format."""
        if not self.resumes_exactly(saved) or self._same_layout(saved):
            return None
        accelerator, stage = self.engine.accelerator, self.engine.strategy.stage
        world_size = self.engine.launch.world_size
        target = output_dir / "universal" / step_dir.name
        failed = target.with_name(target.name + ".failed")  # how the other ranks learn that rank 0's conversion failed
        if accelerator.is_main_process and not target.exists():
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            failed.unlink(missing_ok=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            convert = subprocess.run(
                [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                 str(step_dir / self.folder / TAG), "--output_folder", str(tmp),
                 "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                capture_output=True, text=True)
            if convert.returncode == 0:
                tmp.rename(target)
            else:
                failed.write_text((convert.stderr.strip().splitlines() or ["?"])[-1])
        accelerator.wait_for_everyone()
        if failed.exists():
            raise ConfigError([Problem(f"DeepSpeed could not convert {step_dir} to a universal checkpoint: "
                                       f"{failed.read_text()}", "--resume",
                                       "resume under the ZeRO stage and process count it was saved with")])
        accelerator.state.deepspeed_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}
        self.universal = target
        return (f"resuming a ZeRO-{saved['zero_stage']} checkpoint of {saved['world_size']} process(es) as "
                f"ZeRO-{stage} on {world_size}: converted to DeepSpeed's universal checkpoint "
                f"({target}), optimizer state kept")

    @classmethod
    def load_weights(cls, model: torch.nn.Module, step_dir: Path) -> None:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        load_trained_weights(model, get_fp32_state_dict_from_zero_checkpoint(str(step_dir / cls.folder), tag=TAG,
                                                                              exclude_frozen_parameters=True))
