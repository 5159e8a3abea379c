"""Saving what a run produced: the consolidated final weights (and, with issue 4, resumable checkpoints)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

from safetensors.torch import save_file

from trainkit.config import TrainConfig, config_dict


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

