"""Train a recipe under whatever strategy the launcher selects.

    python train.py --recipe mlp
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --recipe tiny_transformer

Reads top to bottom: plan (trainkit/plan.py: everything that can be checked before a model exists; --dry_run and
--estimate stop there) -> build (the Accelerator, data, model and optimizer, a resumed checkpoint) -> loop (one
optimizer step per iteration: trainkit/step.py) -> finish (final/ and the summary line). The strategies live in
trainkit/strategies/, one module each (the plan holds the strategy; build makes its engine): nothing here knows which
one runs.
"""

from __future__ import annotations

from trainkit.run.restarts import end_if_refused_before

# Before the imports below (seconds of torch): a later attempt of a launch that was refused ends at once.
end_if_refused_before()

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate.utils import set_seed

from trainkit.command_line import parse_command_line
from trainkit.data.batches import BatchLayout, EvalLayout, TrainStream, eval_batches, split_layouts
from trainkit.data.precompute import OwnModel, attach
from trainkit.data.stream import StreamedTrain, open_stream
from trainkit.errors import ConfigError, TrainingError, failure_in_user_code, out_of_memory, said, writing
from trainkit.launch.hardware import Compute
from trainkit.launch.hostfile import exposed_secrets
from trainkit.launch.library_noise import silence_library_noise
from trainkit.launch.rank_exit import (
    LostContact,
    answer_roll_call,
    end_process,
    end_with_launcher,
    keep_until_exit,
    lost_contact,
    outlive_its_terminal,
    publish_failure,
)
from trainkit.models.activation_offload import offloading
from trainkit.models.optimizer import build_optimizer, build_scheduler
from trainkit.plan import Plan, estimate_report, make_plan
from trainkit.run.checkpoint import Checkpointer, continue_from, data_states, export_final, held_rollout
from trainkit.run.metrics import (
    MetricsLog,
    Throughput,
    close_progress_bars,
    end_trackers,
    peak_memory_bytes,
    process_seconds,
    reported_means,
    start_trackers,
    state_bytes,
    summary_line,
)
from trainkit.run.output_folder import STOP_RECORD, check_folder_shared, clear_outputs, record_stop
from trainkit.run.restarts import last_attempt_note, rank_zero_first, record_error
from trainkit.run.stopping import FiniteCheck, StopSignal
from trainkit.step import train_step
from trainkit.strategies.registry import Engine


def main(argv: list[str] | None = None) -> int:
    end_with_launcher()  # a rank never outlives the launcher that started it (trainkit/launch/rank_exit.py)
    outlive_its_terminal()  # but it outlives its closed ssh session, to end a stop it was asked for
    silence_library_noise()
    options = None
    try:
        options, overrides = parse_command_line(argv)
        plan = make_plan(options, overrides)
        if plan.options.estimate:
            print(estimate_report(plan))
            return 0
        if plan.options.dry_run:
            for note in (*plan.strategy.notes, *plan.notes):
                print(f"note: {note}", file=sys.stderr)
            if shown := plan.recipe.preview(plan.cfg, plan.options.cache_dir):  # the data as the model reads it
                print(f"note: {shown}", file=sys.stderr)
            print(json.dumps(dict(plan.resolved), indent=2))
            return 0
        run = build(plan)
        return finish(plan, run, loop(plan, run))
    except (ConfigError, TrainingError) as e:
        return refuse(e, options.output_dir if options else None)
    except SystemExit as e:  # argparse's refusal of the command line, printed above it
        if e.code == 2:
            record_error(["the command line was refused (its usage is printed above)"], refusal=True)
        raise
    except KeyboardInterrupt:  # Ctrl-C while planning or building (from the first step on, StopSignal takes it):
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # every process of the machine got it; its first one says so
            print("error: interrupted (Ctrl-C) before the first step of this launch: nothing was trained and no "
                  "checkpoint changed: run the same command again", file=sys.stderr)
        return 1
    except Exception as e:
        error = lost_contact(e) or out_of_memory(e) or failure_in_user_code(e)
        if error is None or os.environ.get("TRAINKIT_TRACEBACK"):
            if error is None:  # a fault of the runner or a library: the other ranks name it, not this rank's silence
                publish_failure(f"{said(e)} (its traceback is in that rank's output)")
            raise
        return refuse(error, options.output_dir if options else None)


def refuse(error: ConfigError | TrainingError, output_dir: Path | None) -> int:
    """Print the error lines once per launch (rank_zero_first). A cause is published first, for the ranks that lose
    contact with this one to name it (trainkit/launch/rank_exit.py)."""
    lines = error.lines()
    if not isinstance(error, LostContact):  # the cause: the ranks that lose contact with this one name it
        publish_failure(lines[0])
    if note := last_attempt_note(lambda: continue_from(output_dir)):  # --max_restarts used up
        lines.append(note)
    record_error(lines, refusal=isinstance(error, ConfigError))  # for torchrun's report and its next attempt
    rank_zero_first()
    close_progress_bars()
    for line in lines:
        print(f"error: {line}", file=sys.stderr, flush=True)
    return error.exit_status


@dataclass
class Run:
    """What build() made; the engine holds the prepared model, optimizer and schedule."""

    engine: Engine
    resolved: dict[str, Any]  # resolved_config.json: the plan's, with the machine's threads and peak
    checkpointer: Checkpointer
    stream: TrainStream | StreamedTrain
    eval_set: Any
    layout: BatchLayout
    eval_layout: EvalLayout  # every held-out sample once, on any process count
    peak_flops: float | None  # of one process's device, for MFU
    step: int = 0  # the last optimizer step done (a resume starts past 0)
    skipped_steps: int = 0  # fp16's loss scaler, so far
    record: dict[str, Any] = field(default_factory=dict)  # the last step's metrics
    steps_trained: int = 0  # by this launch
    seconds: float = 0.0  # this launch's loop


def build(plan: Plan) -> Run:
    options, cfg, recipe = plan.options, plan.cfg, plan.recipe
    engine = plan.strategy.engine(plan.strategy)
    accelerator = engine.build_accelerator(options.output_dir, options.report_to)
    keep_until_exit(engine)  # freeing its process groups can hang a launched rank (trainkit/launch/rank_exit.py)
    answer_roll_call()  # where this rank runs, for a lost peer's message to name a rank that went silent
    if (leak := exposed_secrets(os.environ, accelerator.is_local_main_process)) and accelerator.is_main_process:
        print(f"warning: {leak}", file=sys.stderr, flush=True)
    compute = Compute.set_up(accelerator, plan.launch.mixed_precision, options.peak_flops, options.cache_dir)
    resolved = compute.resolved(plan.resolved)  # the threads and peak of the machine it runs on
    notes = [*plan.notes, *compute.notes()]  # said once, after the strategy's and the engine's own
    if accelerator.is_main_process:
        if options.overwrite:  # asked for explicitly: the earlier run's outputs go
            clear_outputs(options.output_dir)
        options.output_dir.mkdir(parents=True, exist_ok=True)
        (options.output_dir / STOP_RECORD).unlink(missing_ok=True)  # this launch's end writes its own, if it stops
        with writing(options.output_dir / "resolved_config.json"):
            (options.output_dir / "resolved_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    check_folder_shared(options.output_dir)  # a folder local to each machine would fail only at the first save
    start_trackers(accelerator, options.output_dir, resolved)
    with accelerator.local_main_process_first():  # one process per machine builds the data caches
        train_set, eval_set = recipe.make_datasets(cfg, options.cache_dir)
    layout = BatchLayout(cfg.batch_size, cfg.grad_accum, engine.data_parallel_rank, engine.data_parallel_size)
    held_out, note = split_layouts(layout, train_set, eval_set, cfg.eval_batches)  # refuses empty splits
    notes += [note] if note else []
    checkpointer = Checkpointer(engine, options.output_dir, options.keep_last, options.async_save)
    precompute, resumed = recipe.precompute(cfg), plan.resume.path if plan.resume else None
    if isinstance(precompute, OwnModel):  # values per sample from a model of the recipe's own, before this one
        train_set, eval_set, checkpointer.precomputed = attach(engine, precompute, train_set, eval_set, layout, resumed)
    set_seed(cfg.seed)  # the same initial weights on every rank and in a one-process run
    model = recipe.make_model(cfg)
    if plan.resume and (note := checkpointer.before_prepare(plan.resume, model)):
        notes.append(note)
    engine.prepare(model, build_optimizer, build_scheduler)
    if precompute is not None and not isinstance(precompute, OwnModel):  # values from the model as it starts
        train_set, eval_set, checkpointer.precomputed = attach(engine, precompute, train_set, eval_set, layout, resumed)
    stream = open_stream(train_set, layout, cfg.seed, options.data_workers)
    notes += [stream.note] if stream.note else []
    run = Run(engine, resolved, checkpointer, stream, eval_set, layout, held_out, compute.peak.flops)
    if plan.resume:
        checkpointer.load(plan.resume)  # last: it restores this rank's RNG
        if (held := held_rollout(plan.resume, accelerator.process_index)) is not None:
            recipe.load_rollout_state(held)
        saved = plan.resume.state
        run.stream.seek(saved["epoch"], saved["batch_in_epoch"], data_states(plan.resume))
        run.step, run.skipped_steps = saved["step"], saved["skipped_steps"]
        notes.append(f"resumed from {plan.resume.path} at step {run.step}")
    for note in [*plan.strategy.notes, *engine.notes, *notes] if accelerator.is_main_process else []:
        print(f"note: {note}", file=sys.stderr)
    return run


def loop(plan: Plan, run: Run) -> str | None:
    """Train to --max_steps (or --stop_at); returns what stopped it early (a signal's name, --stop_at) or None."""
    cfg, options, engine = plan.cfg, plan.options, run.engine
    device = engine.accelerator.device
    log = MetricsLog(engine.accelerator, options.output_dir, cfg.max_steps, initial_step=run.step)
    tokens, peak, processes = plan.recipe.tokens_per_sample(cfg), run.peak_flops, engine.accelerator.num_processes
    throughput, finite, signal = Throughput(), FiniteCheck(fp16=plan.launch.mixed_precision == "fp16"), StopSignal()
    held = 0  # model-state bytes: every tensor walked once, after the first step made the optimizer states
    stopped_by, first, started = None, run.step, time.perf_counter()
    loss_fn = offloading(plan.recipe.compute_loss) if cfg.activation_offload else plan.recipe.compute_loss
    for step in range(run.step + 1, min(cfg.max_steps, options.stop_at or cfg.max_steps) + 1):
        waited = time.perf_counter()
        micro_batches = run.stream.next_global_batch()  # read and collated here: the time the step waits for data
        data_wait_s = time.perf_counter() - waited
        rollout_metrics: dict[str, Any] = {}
        # online RL's completions, KTO's reference point: made by the model as it is before the step
        if plan.recipe.rollout is not None and (rolled := engine.rollout(plan.recipe.rollout, step, micro_batches)):
            micro_batches = rolled.micro_batches
            log.rollout_rows(step, rolled.rows)
            rollout_metrics = {**rolled.metrics, "rollout_s": time.perf_counter() - waited - data_wait_s}
        run.checkpointer.poll()  # an asynchronous save that has ended becomes the checkpoint
        result = train_step(engine, step, micro_batches, loss_fn, finite, signal.requested)
        run.step, run.skipped_steps = step, run.skipped_steps + result.skipped
        samples_per_s = throughput.lap(run.layout.global_batch)
        held = held or state_bytes(engine.state_tensors())
        run.record = {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                      "samples_per_s": samples_per_s, "data_wait_s": data_wait_s,
                      "checkpoint_s": run.checkpointer.blocked(),
                      # per process: the global batch's FLOPs over every process's peak (all processes, also those
                      # that split the model rather than the data)
                      "mfu": samples_per_s * plan.flops.per_sample / (peak * processes) if peak else None,
                      "state_bytes": held, "peak_mem_bytes": peak_memory_bytes(device),
                      "skipped_steps": run.skipped_steps, "elapsed_s": process_seconds(), **rollout_metrics,
                      **result.extra,
                      **reported_means(engine.accelerator, plan.recipe.take_reported(),
                                       engine.loss_holders * engine.sequence_parallel_size == processes,
                                       engine.sequence_parallel_size)}
        if tokens:
            run.record["tokens_per_s"] = samples_per_s * tokens
        run.record.update(run.stream.metrics(engine.accelerator, processes // engine.data_parallel_size))
        if step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0):
            batches = eval_batches(run.eval_set, run.eval_layout)
            run.record.update(engine.evaluate(batches, plan.recipe.compute_loss, plan.recipe.evaluation_metrics))
            log.answers(step, engine.generate(plan.recipe.generate, run.eval_set))
        log.step(run.record)
        if result.stop or step == options.stop_at:
            stopped_by = signal.name or "--stop_at"
        if stopped_by or (options.save_every and step % options.save_every == 0):
            run.checkpointer.save(step, run.stream.position, run.skipped_steps, run.resolved, run.stream.rank_state(),
                                  plan.recipe.rollout_state())
        if stopped_by:
            break
    run.checkpointer.wait()  # the last asynchronous save, on disk before the run goes on or ends
    log.close()
    run.steps_trained, run.seconds = run.step - first, time.perf_counter() - started
    return stopped_by


def finish(plan: Plan, run: Run, stopped_by: str | None) -> int:
    """final/ and the summary line; after a stop, only where to continue from."""
    accelerator = run.engine.accelerator
    if stopped_by:
        end_trackers(accelerator, plan.options.output_dir)
        if accelerator.is_main_process:
            checkpoint = run.checkpointer.root / f"step_{run.step}"
            record_stop(plan.options.output_dir, run.step, stopped_by, plan.cfg.max_steps, checkpoint)
            print(f"stopped after step {run.step} ({stopped_by}); checkpoint in {checkpoint}; continue with "
                  f"--resume latest")
        return 0
    final = export_final(run.engine, plan.recipe, plan.cfg, plan.options.cache_dir, plan.options.output_dir)
    end_trackers(accelerator, plan.options.output_dir)
    if accelerator.is_main_process:
        extra = plan.recipe.summary(plan.cfg, plan.options.cache_dir)
        print(summary_line(run.record, run.steps_trained, run.seconds, extra, final, run.layout.global_batch,
                           plan.recipe.tokens_per_sample(plan.cfg)))
        if report := run.engine.report():
            print(report)
    return 0


if __name__ == "__main__":
    end_process(main())
