"""Checkpoints you can trust: atomic saves, exact resume, resume under another strategy, and the final export.

A checkpoint is `checkpoints/step_<N>/`:

    trainer_state.json   step, data position, scheduler, loss scaler, resolved config, and every other file's size and
                         xxh3_64 checksum (written last, by rank 0; checked before a resume loads anything)
    rng/rank_<r>.pt      every rank's RNG states (torch, CUDA, Python, NumPy)
    data/rank_<r>.json   streamed data: where each of the rank's lanes goes on reading (trainkit/data/stream.py)
    precomputed.safetensors  the recipe's values per sample from the model as it started (trainkit/data/precompute.py)
    rollout/rank_<r>.pt  an online-RL recipe's completions that the next steps train on again (recipes/grpo.py's
                         --num_iterations: Recipe.rollout_state)
    routing_biases.safetensors  a mixture of experts' routing biases under --router_bias_update_rate (rank 0;
                         trainkit/models/expert_bias.py): moved by their rule, not by the optimizer
    state/ or deepspeed/ model + optimizer, in the strategy's format (its CheckpointFormat, strategies/dcp_format.py):
                         torch.distributed.checkpoint (single, DDP, FSDP2: reshardable) or DeepSpeed's (ZeRO-1/2/3)

It is written as `step_<N>.tmp`; after every rank's part is on disk (a barrier) rank 0 renames it, then points
`checkpoints/latest` at it (write + rename), and only then prunes beyond --keep_last. A crash at any moment leaves
the previous checkpoint whole and `latest` naming a complete one. Under --async_save the same happens when the write
that went on beside the training has ended on every rank.
"""

from __future__ import annotations

import difflib
import json
import mmap
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from trainkit.config import TrainConfig, config_dict
from trainkit.data import precompute
from trainkit.errors import ConfigError, Problem, TrainingError, said, write_failure, writing
from trainkit.launch.rank_exit import lost_peer
from trainkit.models import expert_bias
from trainkit.recipes import Recipe
from trainkit.strategies.deepspeed_ep import run_ep_size
from trainkit.strategies.registry import Engine, for_format


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


def write_atomically(path: Path, text: str) -> None:
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


@dataclass(slots=True)
class _Write:
    """A save under way: its folders, rank 0's trainer_state (as of its step) and, when asynchronous, the future."""

    tmp: Path
    final: Path
    state: dict[str, Any] | None
    future: Future | None


class Checkpointer:
    """Saves and restores training state under the run's engine (see the module docstring for the layout).

    With `asynchronous` (--async_save) a save copies the state and returns; the write goes on beside the training,
    and the step folder becomes the checkpoint (renamed, `latest`) only when every rank's part is on disk. At most one
    write is in flight: the next save, and the end of the run, first wait for it."""

    def __init__(self, engine: Engine, output_dir: Path, keep_last: int, asynchronous: bool = False):
        self.engine = engine
        self.format = engine.format(engine, asynchronous)  # the model + optimizer part of every step folder
        self.accelerator = engine.accelerator
        self.output_dir = output_dir
        self.root = output_dir / "checkpoints"
        self.keep_last = keep_last
        self.writing: _Write | None = None
        self.blocked_s = 0.0  # the loop's time in save and poll since `blocked()` was last read
        self.precomputed: dict[str, torch.Tensor] = {}  # the recipe's per-sample values (trainkit/data/precompute.py)

    # --- saving -------------------------------------------------------------------------------------------------

    def save(self, step: int, position: tuple[int, int], skipped_steps: int, resolved: dict[str, Any],
             data_state: dict[str, Any] | None = None, held: dict[str, Any] | None = None) -> Path:
        """Write checkpoints/step_<step> (asynchronously: start writing it); a failure to write (a full disk) removes
        the partial folder and stops the run naming the checkpoint that is still whole. data_state: this rank's
        streamed data position, if it has one; held: what its recipe's rollout holds for the next steps, if
        anything."""
        started = time.perf_counter()
        self.wait()
        acc = self.accelerator
        final, tmp = self.root / f"step_{step}", self.root / f"step_{step}.tmp"
        with self._failing(final, tmp):
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)  # the remains of a save that was killed
                (tmp / "rng").mkdir(parents=True)
                if self.precomputed:
                    precompute.save(tmp, self.precomputed)
            acc.wait_for_everyone()
            torch.save(_rng_state(), tmp / "rng" / f"rank_{acc.process_index}.pt")
            if acc.is_main_process and getattr(self.engine.cfg, "router_bias_update_rate", 0.0):
                expert_bias.save(self.engine.unwrapped_model, tmp)  # moved by their rule, not trained: kept here
            if data_state is not None:
                (tmp / "data").mkdir(exist_ok=True)
                (tmp / "data" / f"rank_{acc.process_index}.json").write_text(json.dumps(data_state) + "\n")
            if held is not None:
                (tmp / "rollout").mkdir(exist_ok=True)
                torch.save(held, tmp / "rollout" / f"rank_{acc.process_index}.pt")
            future = self.format.save(tmp)
            state = {
                "format": self.format.name, "format_version": self.format.version,
                "step": step, "epoch": position[0], "batch_in_epoch": position[1],
                "skipped_steps": skipped_steps, "scheduler": self.engine.scheduler.state_dict(),
                "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
                "strategy": resolved["strategy"], "world_size": resolved["world_size"],
                "zero_stage": resolved["zero_stage"], "resolved_config": resolved,
            } if acc.is_main_process else None
        if future is not None and state is not None:
            future = _then_listed(future, tmp)  # the hashing goes on beside the training too
        self.writing = _Write(tmp, final, state, future)
        if future is None:
            self.wait()
        self.blocked_s += time.perf_counter() - started
        return final

    def poll(self) -> None:
        """Between steps: rank 0 makes a finished asynchronous write the checkpoint. Its future ends after every
        rank's (torch.distributed.checkpoint's coordinator writes the metadata once all parts are written), so no
        other rank waits for this."""
        write = self.writing
        if write is not None and write.future is not None and write.future.done() and write.state is not None:
            started = time.perf_counter()
            self._finish(write)
            self.blocked_s += time.perf_counter() - started

    def wait(self) -> None:
        """Every rank: until the write in flight, if any, is on disk and is the checkpoint (a collective)."""
        write = self.writing
        if write is not None and write.future is not None:
            with self._failing(write.final, write.tmp):
                write.future.result()
        self.accelerator.wait_for_everyone()  # every rank's part is on disk
        if write is not None:
            self._finish(write)

    def blocked(self) -> float:
        """The seconds the loop spent in saves since the last call (metrics.jsonl's checkpoint_s)."""
        blocked, self.blocked_s = self.blocked_s, 0.0
        return blocked

    def _finish(self, write: _Write) -> None:
        self.writing = None
        if write.state is None:  # rank 0 renames
            return
        final, tmp = write.final, write.tmp
        with self._failing(final, tmp):
            # what was written, so that a damaged copy is found before anything is loaded from it; a failed
            # asynchronous write raises here
            write.state["files"] = write.future.result() if write.future is not None else _file_table(tmp)
            write_atomically(tmp / "trainer_state.json", json.dumps(write.state, indent=2) + "\n")
            shutil.rmtree(final, ignore_errors=True)  # a re-run of this very step (after a resume)
            os.replace(tmp, final)
            write_atomically(self.root / "latest", final.name + "\n")
        self._prune(_step(final))

    @contextmanager
    def _failing(self, final: Path, tmp: Path) -> Iterator[None]:
        try:
            yield
        except (OSError, RuntimeError, _dcp_error()) as e:  # DCP wraps its ranks' failures in a BaseException
            if isinstance(e, RuntimeError) and lost_peer(e):
                raise
            self.writing = None
            shutil.rmtree(tmp, ignore_errors=True)
            newest = next(iter(_checkpoints(self.root)), None)
            what, fix = write_failure(e, self.root)
            raise TrainingError(f"could not write checkpoint {final}: {what}",
                                f"{newest} is intact; {fix} and continue with --resume latest" if newest else
                                f"no checkpoint was written before it; {fix} and start again (--overwrite)"
                                ) from None

    def _prune(self, newest: int) -> None:
        if self.keep_last <= 0:
            return
        steps = sorted(int(p.name.removeprefix("step_")) for p in self.root.glob("step_*")
                       if p.name.removeprefix("step_").isdigit())
        for old in [s for s in steps if s <= newest][:-self.keep_last]:
            shutil.rmtree(self.root / f"step_{old}")

    # --- restoring ----------------------------------------------------------------------------------------------

    def before_prepare(self, found: Found, model: torch.nn.Module) -> str | None:
        """What must happen before the strategy prepares the model: a checkpoint this strategy cannot restore
        exactly gives its consolidated weights (a warm start, said out loud); one it can restore after a conversion
        is converted. Returns the note that says which, or None."""
        if self.format.resumes_exactly(found.state):
            return self.format.before_resume(found.path, found.state, self.output_dir)
        for_format(found.format).load_weights(model, found.path)
        saved = found.state
        under = saved["strategy"] + (f" (ZeRO-{saved['zero_stage']})" if saved["zero_stage"] else "") + " "
        why = ("it was written in an earlier layout of its format, which this version reads the weights of only"
               if for_format(found.format) is type(self.format) else "this strategy cannot read that optimizer state")
        return (f"resuming a checkpoint saved under {under}on {saved['world_size']} process(es): weights loaded, "
                f"optimizer state starts fresh ({why})")

    def load(self, found: Found) -> None:
        """After prepare: model and optimizer (when exact), scheduler, loss scaler, and this rank's RNG last."""
        acc, engine = self.accelerator, self.engine
        if self.format.resumes_exactly(found.state):
            try:
                self.format.load(found.path)
            except (Exception, _dcp_error()) as e:  # what the checks could not see (an old checkpoint): its words
                if isinstance(e, RuntimeError) and lost_peer(e):
                    raise
                older = newest_intact(found.path.parent, among=lambda p: _step(p) < _step(found.path))
                raise TrainingError(f"could not load checkpoint {found.path}: {said(e)}",
                                    f"resume from an older one (--resume {older})" if older else
                                    "start again (--overwrite)") from None
        expert_bias.load(engine.unwrapped_model, found.path)
        engine.scheduler.load_state_dict(found.state["scheduler"])
        if acc.scaler is not None and found.state["scaler"]:
            acc.scaler.load_state_dict(found.state["scaler"])
        rng_file = found.path / "rng" / f"rank_{acc.process_index}.pt"
        if rng_file.exists():  # a rank the saved run did not have keeps its fresh seed
            _set_rng_state(torch.load(rng_file, weights_only=True))


def held_rollout(found: Found, rank: int) -> dict[str, Any] | None:
    """What rank `rank`'s recipe rollout held when the checkpoint was written (rollout/rank_<r>.pt), or None."""
    path = found.path / "rollout" / f"rank_{rank}.pt"
    return torch.load(path, weights_only=True) if path.exists() else None


def data_states(found: Found) -> list[dict[str, Any]]:
    """Every rank's streamed data position (data/rank_<r>.json), in rank order: a resume on another number of
    processes takes its lanes from all of them. Empty for data that is not streamed."""
    files = sorted((found.path / "data").glob("rank_*.json"), key=lambda f: int(f.stem.removeprefix("rank_")))
    return [json.loads(f.read_text()) for f in files]


def _dcp_error() -> type[BaseException]:
    """torch.distributed.checkpoint's exception (a BaseException), imported only when an error is being matched:
    the package takes 0.6 s to import, in every process of every run."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, newest first."""
    steps = [p for p in root.glob("step_*") if p.name.removeprefix("step_").isdigit()
             and (p / "trainer_state.json").is_file()]
    return sorted(steps, key=_step, reverse=True)


def newest_intact(root: Path, among: Callable[[Path], bool] = lambda path: True) -> Path | None:
    """The newest complete checkpoint under root (of those `among` takes) whose files are as they were written
    (_damage); each is read whole to be checked, so the search stops at the first."""
    return next((p for p in _checkpoints(root) if among(p) and not _damage(p, _state(p))), None)


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())


def _digest(file: Path) -> str:
    """xxh3_64 of the file's bytes: a fast non-cryptographic hash that finds flipped bytes (it is not meant to stand
    against deliberate tampering). Mapped, not read: 16 GB/s from the page cache against 6 read in chunks (measured
    on 2 CPU cores), since the bytes are hashed where they lie instead of copied first."""
    with file.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_64(mapped).hexdigest()


def _file_table(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under folder, with its size and digest: trainer_state.json's `files`, read back by _damage. Rank 0
    reads the files just written, from the page cache as a rule (BENCHMARKS.md: what it costs a save and a load)."""
    return {str(f.relative_to(folder)): {"bytes": f.stat().st_size, "xxh3_64": _digest(f)}
            for f in sorted(folder.rglob("*")) if f.is_file()}


def _then_listed(future: Future, tmp: Path) -> Future:
    """A future that ends once `future` (an asynchronous write) has, with tmp's file table as its result."""
    listed: Future = Future()

    def list_files(written: Future) -> None:
        try:
            written.result()
            listed.set_result(_file_table(tmp))
        except BaseException as e:  # the write's own failure (DCP's is a BaseException), or the listing's
            listed.set_exception(e)

    future.add_done_callback(list_files)
    return listed


def _damage(path: Path, state: dict[str, Any]) -> str | None:
    """The first file of a checkpoint that is missing, or has other bytes than when it was written, if any. Sizes
    are compared for every file before any is read (a truncated file is named at once); checkpoints written before
    digests were recorded (a size alone) are checked by size, those before sizes taken as they are."""
    files = {name: entry if isinstance(entry, dict) else {"bytes": entry}
             for name, entry in state.get("files", {}).items()}
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != entry["bytes"]:
            return f"{file} has {file.stat().st_size} bytes, {entry['bytes']} when it was written"
    for name, entry in files.items():
        if "xxh3_64" in entry and _digest(path / name) != entry["xxh3_64"]:
            return (f"{path / name} holds other bytes than were written (its xxh3_64 checksum differs; the size is "
                    "the same)")
    return None


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def has_latest(output_dir: Path) -> bool:
    return (output_dir / "checkpoints" / "latest").is_file()


def auto_resume(output_dir: Path) -> tuple[str | None, bool, str]:
    """--resume auto, the one command line for a first start and every restart: (the checkpoint to resume, or None
    for a fresh start; whether that fresh start replaces what a run left before its first checkpoint; the note).

    The newest intact checkpoint when there is one (a damaged newer one is passed over, said); a new folder, or one
    whose run died before its first checkpoint (nothing there can be continued: its metrics.jsonl, a killed save's
    step_<N>.tmp), starts fresh. A folder holding only damaged checkpoints, or a finished run's final/ without one,
    is left to the checks of a fresh start, which refuse it naming the fix: nothing there is deleted unasked."""
    complete, intact = _checkpoints(output_dir / "checkpoints"), newest_intact(output_dir / "checkpoints")
    if intact:
        skipped = f" (the newer {', '.join(p.name for p in complete[:complete.index(intact)])} damaged)" \
            if intact != complete[0] else ""
        return str(intact), False, f"--resume auto: continuing from {intact}{skipped}"
    left = [name for name in ("metrics.jsonl", "checkpoints") if (output_dir / name).exists()]
    if complete or (output_dir / "final").exists() or not left:
        return None, False, f"--resume auto: no checkpoint in {output_dir}: a fresh start"
    return None, True, (f"--resume auto: the run in {output_dir} stopped before its first checkpoint; a fresh start "
                        f"replaces what it left ({', '.join(left)})")


def continue_from(output_dir: Path | None) -> str:
    """Where a run that ended goes on from, in words: its newest intact checkpoint, or a fresh start."""
    newest = newest_intact(output_dir / "checkpoints") if output_dir else None
    return (f"once it is removed, run the same command with --resume auto: it continues from {newest}" if newest else
            "no checkpoint was written: once the cause is removed, the same command with --resume auto starts anew")


def find_checkpoint(output_dir: Path, resume: str) -> Found:
    """The checkpoint `--resume latest|PATH` names; refuses anything incomplete or damaged, naming what can work."""
    where = f"--resume {resume}"
    if resume == "latest":
        if not has_latest(output_dir):
            final = output_dir / "final"
            fine_tune = f"fine-tune from them with --recipe causal_lm --model_name_or_path {final} and" \
                if '"model_type"' in _text(final / "config.json") else "start a new run in"
            fix = ("the run there finished without saving a checkpoint to continue from (--save_every), and its "
                   f"weights are in {final}: {fine_tune} a new --output_dir; --overwrite would delete them"
                   if final.is_dir() else
                   "the run there stopped before its first checkpoint: start it again with --overwrite, without "
                   "--resume" if (output_dir / "metrics.jsonl").exists() else
                   "start without --resume, or pass --resume PATH to a checkpoint")
            raise ConfigError([Problem(f"no checkpoint to resume in {output_dir}", where, fix)])
        path = output_dir / "checkpoints" / (output_dir / "checkpoints" / "latest").read_text().strip()
    else:
        path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        close = difflib.get_close_matches(resume, ["latest"], n=1) if not path.exists() else []
        raise ConfigError([Problem(f"{path} is not a complete checkpoint (no trainer_state.json)", where,
                                   "did you mean --resume latest?" if close else
                                   "pass a checkpoints/step_<N> folder, or latest")])
    state = _state(path)
    damage = _damage(path, state)
    if damage:
        intact = newest_intact(path.parent, among=lambda p: p != path)
        raise ConfigError([Problem(f"checkpoint {path} is damaged: {damage}", where,
                                   f"resume from the newest intact one: --resume {intact}" if intact else
                                   "no intact checkpoint is left: start again (--overwrite)")])
    return Found(path, state)


def resume_problems(found: Found, cfg: TrainConfig, resolved: dict[str, Any],
                    overrides: list[tuple[str, str, str]]) -> list[Problem]:
    """A resumed run continues the checkpoint's run: the same recipe, the same global batches (seed, global batch
    size) and every setting the recipe does not list in `may_change_on_resume`. The others came from the checkpoint
    unless a flag set them; a flag that sets one to another value is refused (it would not continue the run)."""
    saved = found.state["resolved_config"]
    problems = []
    fixes = {"recipe": f"resume with --recipe {saved['recipe']}, or start a new run",
             "global_batch_size": "keep batch_size x grad_accum x data-parallel size as it was (the data order "
                                  "depends on it): pass --batch_size or --grad_accum to match"}
    for key, fix in fixes.items():
        if saved[key] != resolved[key]:
            problems.append(Problem(f"{key} is {resolved[key]} but the checkpoint was trained with {saved[key]}",
                                    f"--resume {found.path}", fix))
    for name, _, where in overrides:
        if name in config_dict(cfg) and name not in cfg.may_change_on_resume and name in saved \
                and getattr(cfg, name) != saved[name]:
            problems.append(Problem(f"{name} is {getattr(cfg, name)} but the checkpoint was trained with "
                                    f"{saved[name]}", where,
                                    f"drop {where}: a resumed run keeps the checkpoint's {name}; or start a new run"))
    if "base_weights_digest" in saved and saved["base_weights_digest"] != resolved.get("base_weights_digest", ""):
        problems.append(Problem(f"the weights in {cfg.model_name_or_path} are not the base the checkpoint's adapters "
                                f"were trained over (their digest is {resolved.get('base_weights_digest') or 'none'}, "
                                f"the checkpoint's {saved.get('base_weights_digest') or 'none'}): the adapters would "
                                "continue over another model", "--model_name_or_path",
                                "resume with the base folder the run started from, or start a new run over this one "
                                "(another --output_dir)"))
    ep, now = run_ep_size(saved), run_ep_size(resolved)
    if (ep > 1 or now > 1) and (ep, saved["zero_stage"], saved["world_size"]) != (now, resolved["zero_stage"],
                                                                                   resolved["world_size"]):
        what = (f"the checkpoint was saved under DeepSpeed's AutoEP (autoep_size {ep}, ZeRO-{saved['zero_stage']}, "
                f"{saved['world_size']} processes): each rank's own experts in AutoEP's layout, which resume under "
                f"that layout only") if ep > 1 else \
            (f"the checkpoint was saved without DeepSpeed's AutoEP, which this run splits the experts with "
             f"(autoep_size {now}): its optimizer groups (the experts' of their own) and schedule would not match "
             f"the checkpoint's")
        problems.append(Problem(what, f"--resume {found.path}",
                                "resume with the config it was saved with, or fine-tune from its run's final/ "
                                "(--model_name_or_path)"))
    return problems


def export_final(engine: Engine, recipe: Recipe, cfg: TrainConfig, cache_dir: Path, output_dir: Path) -> Path:
    """Consolidated weights in output_dir/final, whatever the strategy; written by the main process only.

    Gathering the full state dict is a collective (every rank calls this). The folder is written under a temporary
    name and renamed, so `final/` is never half-written.
    """
    accelerator = engine.accelerator
    state_dict = engine.full_state_dict()
    final = output_dir / "final"
    if accelerator.is_main_process:
        tmp = output_dir / "final.tmp"
        try:
            with writing(final):
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                with engine.building_alone():
                    recipe.export(engine.unwrapped_model, state_dict, cfg, cache_dir, tmp)
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves no half-written folder
    accelerator.wait_for_everyone()
    return final
