"""Throughput of every strategy, against the tools users would pick instead; writes BENCHMARKS.md and one chart each.

    python bench/throughput.py                      # all four sections, about 35 minutes on 2 quiet CPU cores
    python bench/throughput.py --section peers      # one section: configs | peers | accum | scaling | all
    python bench/throughput.py --quick              # a few configs, 8 steps: checks that everything runs

Sections (each writes its own block of BENCHMARKS.md between markers, and a PNG in docs/images/):
- configs: every shipped config (trainkit.strategies.registry.shipped_strategies, and pipeline stages on ddp.yaml)
  on the tiny transformer and the MLP at one global batch: throughput, MFU, state bytes and peak memory of rank 0, and
  the time from process start to the end of the first step (metrics.jsonl's elapsed_s).
- peers: trainkit against the Hugging Face Trainer and a plain Accelerate loop (bench/peers/), same model, data,
  micro-batch, AdamW, schedule, clipping and precision (fp32), one strategy at a time; and `python train.py` against
  a bare PyTorch loop. A peer that runs something other than the strategy asked for is reported, not timed.
- accum: the same global batch in k = 1, 2, 4 micro-batches per process.
- scaling: 1, 2 and 4 processes at the same micro-batch per process, with the communication share of a step.

Every run is short (24 optimizer steps, evaluation only at the end) and runs alone: throughput is the median over
steps 7-24 (the first steps warm up allocators and caches). Each process gets cores / processes threads (at least
1), set with OMP_NUM_THREADS for trainkit and the peers alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import replace_section  # noqa: E402

from trainkit.launch.hardware import cpu_cores  # noqa: E402
from trainkit.launch.train_process import run_config  # noqa: E402
from trainkit.recipes import load_recipe  # noqa: E402
from trainkit.strategies.registry import for_launch, shipped_strategies  # noqa: E402
from trainkit.tools.compare import split_for  # noqa: E402

CORES = cpu_cores()  # what trainkit divides among its processes (trainkit/launch/hardware.py)
SEQ_LEN = 128  # the tiny transformer's default, stated in every section
MICRO_BATCH = {"tiny_transformer": 16, "mlp": 32}  # per process, at 2 processes
PEERS = Path("bench") / "peers"
REPEATS = 3  # peers: runs of each tool, by default


@dataclass(frozen=True)
class Settings:
    steps: int  # optimizer steps per run
    first: int  # the first step of the timed window (steps first..steps)
    quick: bool
    repeats: int  # peers: runs of each tool, alternating; the median run counts
    markdown: Path
    images: Path
    peer_strategies: tuple[str, ...] = ()  # peers: a subset of PEER_STRATEGIES; empty: all

    @property
    def window(self) -> str:
        return f"steps {self.first}-{self.steps}"


@dataclass
class Result:
    """One run: throughput (tokens/s, or samples/s for the MLP) over the window, or why there is none."""

    rate: float | None = None
    best: float | None = None  # the fastest step's throughput: noise only slows steps, so it shows per-step cost
    mfu: float | None = None
    state_bytes: int | None = None
    peak_mem_bytes: int | None = None
    first_step_s: float | None = None
    wall_s: float = 0.0
    problem: str | None = None  # "failed: ..." or "not supported on CPU: ..."
    extra: dict = field(default_factory=dict)

    def cell(self, digits: int = 0) -> str:
        return f"{self.rate:,.{digits}f}" if self.rate is not None else self.problem or "-"


def threads_for(processes: int) -> int:
    return max(1, CORES // processes)


def last_error(stderr: str) -> str:
    """trainkit's first `error:` line, else the last exception message of a rank (not the launcher's summary)."""
    lines = stderr.splitlines()
    ours = [line for line in lines if line.startswith("error:")]
    raised = [line for line in lines if re.search(r"\w+(Error|Exception): \S", line) and "ChildFailedError" not in line]
    found = ours[0] if ours else raised[-1] if raised else (stderr.strip().splitlines() or ["no output"])[-1]
    return " ".join(found.split())[:200]


# --- trainkit runs ------------------------------------------------------------------------------------------------


def trainkit(settings: Settings, tmp: Path, name: str, config: str | None, args: list[str],
             processes: int = 1, threads: int | None = None) -> Result:
    """`python train.py` (config None) or `accelerate launch --config_file CONFIG train.py`, read from metrics.jsonl."""
    out = tmp / name
    started = time.perf_counter()
    run = run_config(config, out, [*args, "--max_steps", str(settings.steps), "--eval_every", "0"],
                     processes if config else None, env={"OMP_NUM_THREADS": str(threads or threads_for(processes))})
    wall = time.perf_counter() - started
    if run.returncode != 0 or len(run.metrics) < settings.steps:
        return Result(wall_s=wall, problem=f"failed: {last_error(run.stderr)}")
    window = [m for m in run.metrics if settings.first <= m["step"] <= settings.steps]
    rate_key = "tokens_per_s" if "tokens_per_s" in window[0] else "samples_per_s"
    mfus = [m.get("mfu") for m in window]
    return Result(rate=statistics.median(m[rate_key] for m in window), best=max(m[rate_key] for m in window),
                  mfu=statistics.median(mfus) if None not in mfus else None,
                  state_bytes=run.metrics[-1]["state_bytes"],
                  peak_mem_bytes=max(m["peak_mem_bytes"] for m in run.metrics),
                  first_step_s=run.metrics[0].get("elapsed_s"), wall_s=wall,
                  extra={"step_s": statistics.median(m["samples_per_s"] for m in window)})


# --- peer runs -----------------------------------------------------------------------------------------------------


def accelerate_yaml(strategy: str, processes: int, tmp: Path) -> Path:
    """The shipped YAML, and for DeepSpeed what a plain script needs on top of it. Accelerate refuses the shipped
    DeepSpeed YAMLs' `mixed_precision` next to a `deepspeed_config_file` (trainkit's runner tells it that the JSON is
    the one source), and cannot fill the JSON's "auto" allgather_bucket_size: a copy of the YAML without it, naming a
    copy of the JSON with the bucket sizes that trainkit's runner fills (trainkit/strategies/deepspeed_config.py)."""
    import yaml

    from trainkit.strategies.deepspeed_config import fill_bucket_sizes

    shipped = ROOT / "accelerate_configs" / f"{'single' if processes == 1 else strategy}.yaml"
    if not strategy.startswith("deepspeed"):
        return shipped
    settings = yaml.safe_load(shipped.read_text())
    settings.pop("mixed_precision")
    ds = json.loads((ROOT / settings["deepspeed_config"]["deepspeed_config_file"]).read_text())
    recipe = load_recipe("tiny_transformer")
    fill_bucket_sizes(ds, recipe.build_model(recipe.Config()))
    settings["deepspeed_config"]["deepspeed_config_file"] = str(tmp / f"{strategy}.json")
    (tmp / f"{strategy}.json").write_text(json.dumps(ds))
    (tmp / f"{strategy}.yaml").write_text(yaml.safe_dump(settings))
    return tmp / f"{strategy}.yaml"


def peer_command(tool: str, strategy: str, processes: int, report: Path, args: list[str]) -> list[str]:
    """How a user starts each peer: the Trainer with torchrun, the Accelerate loop with `accelerate launch` and the
    shipped YAML (`--cpu` as in Accelerate's examples, except under DeepSpeed, where it would select DDP)."""
    script = str(PEERS / f"{tool}.py")
    common = [*args, "--report", str(report)]
    if tool == "torch_loop" or (processes == 1 and tool != "accelerate_loop"):
        return [sys.executable, script, *common]
    if tool == "hf_trainer":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                script, "--strategy", strategy, *common]
    config = str(accelerate_yaml(strategy, processes, report.parent))
    cpu = [] if strategy.startswith("deepspeed") else ["--cpu"]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port", "0",
            "--num_processes", str(processes), script, *cpu, *common]


def not_what_was_asked(strategy: str, processes: int, ran: dict) -> str | None:
    """What the peer ran instead of `strategy` on `processes` processes, or None when it ran that."""
    wrappers = " > ".join(ran["wrappers"])
    if ran["num_processes"] != processes or ran["world_size"] != processes:
        return f"{ran['num_processes']} process(es) in Accelerate, a world of {ran['world_size']}, not {processes}"
    if strategy == "ddp" and "DistributedDataParallel" not in ran["wrappers"]:
        return f"ran {wrappers}, not DDP"
    if strategy.startswith("deepspeed_zero") and ran["zero_stage"] != int(strategy[-1]):
        return f"ran {wrappers} (ZeRO stage {ran['zero_stage']}), not ZeRO-{strategy[-1]}"
    if strategy == "fsdp" and not ran["sharded"]:
        return f"ran {wrappers} ({ran['distributed_type']}), whole parameters: FSDP not applied"
    return None


def peer(settings: Settings, tmp: Path, tool: str, strategy: str, processes: int, micro_batch: int,
         grad_accum: int = 1, flags: tuple[str, ...] = ()) -> Result:
    report = tmp / f"{tool}-{strategy}-{processes}-{grad_accum}{''.join(flags)}.json"
    args = ["--batch_size", str(micro_batch), "--grad_accum", str(grad_accum), "--max_steps", str(settings.steps),
            *flags]
    report.unlink(missing_ok=True)  # a repeat's report, not an earlier one
    started = time.perf_counter()
    proc = subprocess.run(peer_command(tool, strategy, processes, report, args), cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads_for(processes))})
    wall = time.perf_counter() - started
    if not report.exists():  # a ZeRO-3 rank may abort at exit after the report is written: the report decides
        return Result(wall_s=wall, problem=f"failed: {last_error(proc.stderr)}")
    data = json.loads(report.read_text())
    ends, ran = data["step_end_s"], data["ran"]
    if (instead := not_what_was_asked(strategy, processes, ran)) is not None:
        return Result(wall_s=wall, problem=f"not supported on CPU: {instead}", extra={"ran": ran})
    durations = [b - a for a, b in zip(ends, ends[1:], strict=False)][settings.first - 2:settings.steps - 1]
    tokens = processes * micro_batch * grad_accum * SEQ_LEN
    return Result(rate=tokens / statistics.median(durations), best=tokens / min(durations),
                  first_step_s=data["first_step_s"], wall_s=wall, extra={"ran": ran})


# --- sections ------------------------------------------------------------------------------------------------------


def section_configs(settings: Settings, tmp: Path) -> tuple[str, Callable]:
    rows = []
    quick = {"ddp", "hsdp", "tp"}
    for recipe, micro in MICRO_BATCH.items():
        loaded = load_recipe(recipe)
        cfg, global_batch = loaded.Config(), 2 * micro
        base = ["--recipe", recipe]
        runs = [("single (python train.py)", None, 1, [*base, "--batch_size", str(global_batch)])]
        for name, launch in shipped_strategies().items():
            if settings.quick and name not in quick:
                continue
            if recipe == "mlp" and for_launch(launch, cfg, {}, loaded).splits_model:
                continue  # the MLP declares no tensor-parallel plan: refused, by design
            if for_launch(launch, cfg, {}, loaded).needs_experts:
                continue  # expert parallelism: a mixture of experts only (bench/moe.py ep)
            processes, micro_batch = split_for(name, recipe, 2, global_batch, 1)
            runs.append((name, name, processes, [*base, "--batch_size", str(micro_batch)]))
        if loaded.pipeline_layers is not None:  # 2 stages on ddp.yaml; 4 micro-batches of 8 make the global batch
            runs.append(("pipeline (ddp.yaml, 2 stages, 1f1b, 4 x 8)", "ddp", 2,
                         [*base, "--pipeline_stages", "2", "--batch_size", str(global_batch // 4), "--grad_accum",
                          "4"]))
        for label, config, processes, args in runs:
            result = trainkit(settings, tmp, f"{recipe}-{label.split()[0]}", config, args, processes)
            rows.append((recipe, label, processes, int(args[args.index("--batch_size") + 1]), result))
            print(f"configs: {recipe} {label}: {result.cell()}", flush=True)

    def mib(n: int | None) -> str:
        return f"{n / 2**20:,.1f}" if n is not None else "-"

    table = ["| recipe | config | processes x threads | micro-batch | throughput | MFU | state MiB/rank | "
             "peak RSS MiB (rank 0) | first step s | run s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for recipe, label, processes, micro_batch, r in rows:
        unit = "tokens/s" if recipe == "tiny_transformer" else "samples/s"
        table.append(f"| {recipe} | {label} | {processes} x {threads_for(processes)} | {micro_batch} | "
                     f"{r.cell()}{' ' + unit if r.rate else ''} | {f'{r.mfu:.1%}' if r.mfu is not None else '-'} | "
                     f"{mib(r.state_bytes)} | {mib(r.peak_mem_bytes)} | "
                     f"{f'{r.first_step_s:.1f}' if r.first_step_s is not None else '-'} | {r.wall_s:.0f} |")
    text = ("Global batch: tiny transformer 32 x 128 tokens, MLP 64 samples, one micro-batch per process "
            "of each data-parallel group (tp: both processes see the whole batch; fsdp_tp and hsdp run the 4 "
            "processes their YAML fixes). State is parameters + gradients + optimizer states held by rank 0; peak "
            "RSS is rank 0's resident memory (model, data, libraries); first step is metrics.jsonl's elapsed_s of "
            "step 1: process start, imports, data, building and sharding the model, and the first step.\n\n"
            + "\n".join(table))

    def chart(ax_png: Path) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 5))
        for ax, (recipe, unit) in zip(axes, (("tiny_transformer", "tokens/s"), ("mlp", "samples/s")), strict=True):
            mine = [(label, r) for rec, label, _, _, r in rows if rec == recipe and r.rate]
            ax.barh([label.split(" (")[0] for label, _ in mine], [r.rate for _, r in mine], color="tab:blue")
            ax.invert_yaxis()
            ax.set_xlabel(unit)
            ax.set_title(f"{recipe}, {window_note(settings)}")
        fig.tight_layout()
        fig.savefig(ax_png, dpi=100)
        plt.close(fig)

    return text, chart


def window_note(settings: Settings) -> str:
    return f"median of {settings.window}"


def paired_ratios(ours: list[Result], theirs: list[Result]) -> list[float]:
    """trainkit's throughput over a peer's, round by round, where both ran."""
    return [a.rate / b.rate for a, b in zip(ours, theirs, strict=True) if a.rate and b.rate]


def median_run(results: list[Result]) -> Result:
    """The run of median throughput (the lower middle one of an even count); a failed run if none has a rate."""
    timed = sorted((r for r in results if r.rate is not None), key=lambda r: r.rate)
    return timed[(len(timed) - 1) // 2] if timed else results[0]


PEER_STRATEGIES = ("single", "ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp")
TOOLS = {"trainkit": "trainkit", "hf_trainer": "HF Trainer", "accelerate_loop": "Accelerate loop"}


def section_peers(settings: Settings, tmp: Path) -> tuple[str, Callable]:
    micro = MICRO_BATCH["tiny_transformer"]
    strategies = ("single", "deepspeed_zero2", "fsdp") if settings.quick else settings.peer_strategies or \
        PEER_STRATEGIES
    base = ["--recipe", "tiny_transformer", "--batch_size", str(micro)]
    results: dict[str, dict[str, Result]] = {}
    median: dict[str, dict[str, float | None]] = {}  # the median run's throughput of each tool
    best: dict[str, dict[str, float | None]] = {}  # each tool's fastest step over all its runs
    paired: dict[str, dict[str, list[float]]] = {}  # trainkit / tool, round by round (neighbours in time)
    for strategy in strategies:
        processes = 1 if strategy == "single" else 2
        tools = [*TOOLS, *(["torch_loop"] if strategy == "single" else [])]
        runs: dict[str, list[Result]] = {tool: [] for tool in tools}
        for i in range(settings.repeats):  # in turn, so that a slow spell of the machine hits every tool alike
            for tool in tools:
                runs[tool].append(trainkit(settings, tmp, f"peers-{strategy}-{i}",
                                           None if strategy == "single" else strategy, base, processes)
                                  if tool == "trainkit" else peer(settings, tmp, tool, strategy, processes, micro))
        paired[strategy] = {tool: paired_ratios(runs["trainkit"], r) for tool, r in runs.items() if tool != "trainkit"}
        results[strategy] = {tool: median_run(r) for tool, r in runs.items()}
        median[strategy] = {tool: r.rate for tool, r in results[strategy].items()}
        best[strategy] = {tool: max((x.best for x in r if x.best), default=None) for tool, r in runs.items()}
        print(f"peers: {strategy}: " + ", ".join(f"{k} {v.cell()}" for k, v in results[strategy].items()), flush=True)

    def ratio(strategy: str, tool: str, rates: dict[str, dict[str, float | None]]) -> str:
        ours, theirs = rates[strategy]["trainkit"], rates[strategy][tool]
        return f"{ours / theirs:.2f}x" if ours and theirs else "-"

    def first(r: Result) -> str:
        return f"{r.first_step_s:.1f}" if r.first_step_s is not None else "-"

    table = ["| strategy | processes x threads | trainkit tokens/s | HF Trainer tokens/s | Accelerate loop tokens/s | "
             "trainkit / Trainer | trainkit / Accelerate loop | fastest step: trainkit / Trainer | fastest step: "
             "trainkit / Accelerate loop | first step s (trainkit / Trainer / loop) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for strategy, r in results.items():
        processes = 1 if strategy == "single" else 2
        table.append(f"| {strategy} | {processes} x {threads_for(processes)} | "
                     + " | ".join(r[t].cell() for t in TOOLS) + " | "
                     + " | ".join(ratio(strategy, tool, rates) for rates in (median, best)
                                  for tool in ("hf_trainer", "accelerate_loop"))
                     + " | " + " / ".join(first(r[t]) for t in TOOLS) + " |")
    single = results["single"]
    bare = ["| `python train.py` tokens/s | bare PyTorch loop tokens/s | ratio | fastest step ratio |",
            "|---:|---:|---:|---:|",
            f"| {single['trainkit'].cell()} | {single['torch_loop'].cell()} | "
            f"{ratio('single', 'torch_loop', median)} | {ratio('single', 'torch_loop', best)} |"]
    rounds = ["| strategy | against | median of the rounds' ratios | lowest | highest | rounds at or above 1.0x |",
              "|---|---|---:|---:|---:|---:|"]
    for strategy, tools in paired.items():
        for tool, ratios in tools.items():
            if ratios:
                rounds.append(f"| {strategy} | {({**TOOLS, 'torch_loop': 'bare PyTorch loop'})[tool]} | "
                              f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}x | {max(ratios):.2f}x | "
                              f"{sum(r >= 1.0 for r in ratios)} of {len(ratios)} |")
    text = (f"Tiny transformer (recipes/tiny_transformer.py's build_model), 128-token blocks of the same data, "
            f"micro-batch {micro} per process, fp32, AdamW (lr 3e-3, weight decay 0.01 on matrices, betas (0.9, "
            "0.999), eps 1e-8; torch's fused kernel in every tool, the Trainer's default adamw_torch_fused), warm-up "
            "+ cosine schedule, clipping at 1.0; all three in one run of this script, "
            f"each run {settings.repeats} time(s) in turn and the run of median throughput shown (on this machine the "
            "same command varies by up to 30% from run to run). The fastest-step columns compare each tool's fastest "
            "step over all its runs: a busy spell of the machine only slows steps, so the fastest step is what a step "
            "costs the tool itself, and their ratio shows a per-step overhead that the medians' noise hides. "
            "The Trainer (bench/peers/hf_trainer.py) is started with torchrun (`python` for one process) and gets "
            "the same ds_configs/ JSON, with the bucket sizes filled as trainkit fills them (the Trainer leaves "
            "allgather_bucket_size \"auto\" and raises) and its FSDP settings (`fsdp=\"full_shard\"`, version 2); "
            "on a CPU its DeepSpeed runs only with a gloo state configured beforehand (`use_configured_state`). The "
            "Accelerate loop (bench/peers/accelerate_loop.py, written as Accelerate's nlp_example.py) runs under "
            "the same accelerate_configs/ YAML with `--cpu` (DeepSpeed: the gloo backend instead). A peer that ran "
            "something other than the strategy asked for (checked from its model wrapper, ZeRO stage, DTensor "
            "parameters and process count) reads \"not supported on CPU\" with what it ran. What trainkit does in "
            "every step that the loops do not: one all-reduce of the mean loss and the stop flag, one transfer to the "
            "host that also brings the gradient norm, the finite checks, and a metrics.jsonl line.\n\n"
            + "\n".join(table) + "\n\nThe runner against a bare PyTorch loop (bench/peers/torch_loop.py: the same "
            "model, data, AdamW, schedule and clipping, nothing else), one process:\n\n" + "\n".join(bare)
            + "\n\nRound by round: in each round every tool runs once, one after the other, so a round's ratio "
            "compares neighbours in time; a ratio below 1.0x in every round is a gap, rounds on both sides are "
            "noise:\n\n" + "\n".join(rounds))

    def chart(png: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.5))
        tools = [*TOOLS, "torch_loop"]
        width = 0.8 / len(tools)
        for i, tool in enumerate(tools):
            xs = [j + i * width for j, s in enumerate(results) if tool in results[s]]
            ys = [results[s][tool].rate or 0 for s in results if tool in results[s]]
            ax.bar(xs, ys, width, label={**TOOLS, "torch_loop": "bare PyTorch loop"}[tool])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))], list(results))
        ax.set_ylabel("tokens/s (0: not supported on CPU)")
        ax.set_title(f"tiny transformer, trainkit vs peers, {window_note(settings)}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        plt.close(fig)

    return text, chart


ACCUM_STRATEGIES = ("ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp")


def section_accum(settings: Settings, tmp: Path) -> tuple[str, Callable]:
    micro = MICRO_BATCH["tiny_transformer"]
    strategies, ks = (("ddp", "deepspeed_zero2"), (1, 4)) if settings.quick else (ACCUM_STRATEGIES, (1, 2, 4))
    results: dict[str, dict[int, Result]] = {}
    for strategy in strategies:
        results[strategy] = {}
        for k in ks:
            args = ["--recipe", "tiny_transformer", "--batch_size", str(micro // k), "--grad_accum", str(k)]
            results[strategy][k] = trainkit(settings, tmp, f"accum-{strategy}-{k}", strategy, args, 2)
            print(f"accum: {strategy} k={k}: {results[strategy][k].cell()}", flush=True)
    table = ["| strategy | " + " | ".join(f"k = {k} ({micro // k} x {k})" for k in ks) + f" | k = {ks[-1]} / k = 1 |",
             "|---|" + "---:|" * (len(ks) + 1)]
    for strategy, r in results.items():
        slow = f"{r[ks[-1]].rate / r[1].rate:.2f}" if r[1].rate and r[ks[-1]].rate else "-"
        table.append(f"| {strategy} | " + " | ".join(r[k].cell() for k in ks) + f" | {slow} |")
    text = (f"Tiny transformer, 2 processes x {threads_for(2)} thread(s), global batch 2 x {micro} = {2 * micro} "
            "blocks of 128 tokens in every column, split into k micro-batches per process; tokens/s.\n\n"
            + "\n".join(table) + "\n\n"
            "DDP all-reduces once per step: Accelerate's `accumulate` turns DDP's gradient hooks off (`no_sync`) on "
            "all but the last micro-batch. FSDP2 reduce-scatters once per step as well (the runner calls "
            "`set_requires_gradient_sync(False)` on all but the last), but with `reshard_after_forward` it "
            "all-gathers every unit's parameters again in each micro-batch's forward and backward. DeepSpeed ZeRO-2 "
            "and ZeRO-3 pay for every micro-batch: a rank keeps only its own partition of the gradients, so each "
            "micro-batch's gradients must be reduce-scattered into the partitions as its backward produces them "
            "(DeepSpeed's `no_sync` refuses stages 2 and 3 for this reason), and ZeRO-3 also all-gathers the "
            "parameters for every micro-batch's forward and backward. Smaller micro-batches also make each matrix "
            "product smaller, which costs every strategy some efficiency.")

    def chart(png: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for strategy, r in results.items():
            ax.plot(ks, [r[k].rate for k in ks], marker="o", label=strategy)
        ax.set_xticks(ks)
        ax.set_xlabel(f"micro-batches per step (global batch {2 * micro} fixed)")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Accumulation, tiny transformer, 2 processes, {window_note(settings)}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        plt.close(fig)

    return text, chart


SCALING_STRATEGIES = ("ddp", "deepspeed_zero2", "fsdp")


def section_scaling(settings: Settings, tmp: Path) -> tuple[str, Callable]:
    micro = MICRO_BATCH["tiny_transformer"]
    strategies, counts = (("ddp",), (1, 2)) if settings.quick else (SCALING_STRATEGIES, (1, 2, 4))
    # A tenth held out (the recipe's default is 5%): the final evaluation needs a global batch of 4 x 16 blocks.
    args = ["--recipe", "tiny_transformer", "--batch_size", str(micro), "--eval_fraction", "0.1"]
    # Compute-only baseline: one process, no communication, the micro-batch and thread count of a process of the run.
    baseline = {t: trainkit(settings, tmp, f"scaling-base-{t}", None, args, threads=t)
                for t in sorted({threads_for(n) for n in counts})}
    results: dict[str, dict[int, Result]] = {}
    for strategy in strategies:
        # DDP on one process is one process without a wrapper: the baseline run itself.
        results[strategy] = {n: baseline[threads_for(1)] if (strategy, n) == ("ddp", 1) else
                             trainkit(settings, tmp, f"scaling-{strategy}-{n}", strategy, args, n) for n in counts}
        print(f"scaling: {strategy}: " + ", ".join(f"{n}: {r.cell()}" for n, r in results[strategy].items()),
              flush=True)
    no_sync = {n: {flag: peer(settings, tmp, "accelerate_loop", "ddp", n, micro, flags=flags)
                   for flag, flags in (("sync", ()), ("no_sync", ("--no_sync",)))} for n in counts if n > 1}

    def share(n: int, r: Result) -> float | None:
        base = baseline[threads_for(n)]
        if not (base.rate and r.rate):
            return None
        oversubscribed = max(1.0, n * threads_for(n) / CORES)  # 4 processes x 1 thread on 2 cores: each runs half
        compute_s = micro * SEQ_LEN / base.rate * oversubscribed
        step_s = n * micro * SEQ_LEN / r.rate
        return max(0.0, 1 - compute_s / step_s)

    def pct(x: float | None) -> str:
        return f"{x:.0%}" if x is not None else "-"

    table = ["| strategy | " + " | ".join(f"{n} process{'es' if n > 1 else ''} x {threads_for(n)}" for n in counts)
             + " | " + " | ".join(f"comm. share at {n}" for n in counts) + " |",
             "|---|" + "---:|" * (2 * len(counts))]
    for strategy, r in results.items():
        table.append(f"| {strategy} | " + " | ".join(r[n].cell() for n in counts) + " | "
                     + " | ".join(pct(share(n, r[n])) for n in counts) + " |")
    direct = {n: (1 - v["sync"].rate / v["no_sync"].rate) if v["sync"].rate and v["no_sync"].rate else None
              for n, v in no_sync.items()}
    table.append("| DDP, Accelerate loop: all-reduce share (with vs without `no_sync`) | " + " | ".join(
        "-" if n == 1 else f"{no_sync[n]['sync'].cell()} / {no_sync[n]['no_sync'].cell()}" for n in counts) + " | "
        + " | ".join("-" if n == 1 else pct(direct[n]) for n in counts) + " |")
    oversubscribed = [n for n in counts if n > CORES]
    text = (f"Tiny transformer, micro-batch {micro} x 128 tokens per process (the global batch grows with the "
            f"processes; a tenth of the corpus held out so that the final evaluation finds 4 x 16 blocks), "
            f"tokens/s of the whole run; one process is the YAML with `--num_processes 1` (DDP: "
            f"`python train.py`, a world of one has nothing to wrap). This machine has {CORES} cores: each process "
            f"gets cores / processes threads, at least 1"
            + (f"; {', '.join(map(str, oversubscribed))} processes are oversubscribed (1 thread each, two "
               "processes per core), so their throughput cannot exceed that of 2" if oversubscribed else "") + ".\n\n"
            "Communication share: the part of a step that is not this process's own compute. The compute time is "
            "measured by `python train.py` on one process with the same micro-batch and thread count ("
            + ", ".join(f"{t} thread(s): {b.cell()} tokens/s" for t, b in baseline.items()) + "), times the "
            "oversubscription factor where processes outnumber cores; share = 1 - compute time / step time. It "
            "counts everything the strategy adds to a one-process step: collectives, waiting for the slower rank, "
            "ZeRO's and FSDP's partitioning work. The last row measures DDP's all-reduce directly in the Accelerate "
            "loop: the same run with the all-reduce skipped (`no_sync` on every step; timing only) against with it, "
            "tokens/s shown as with / without.\n\n" + "\n".join(table))

    def chart(png: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for strategy, r in results.items():
            left.plot(counts, [r[n].rate for n in counts], marker="o", label=strategy)
            right.plot(counts, [share(n, r[n]) for n in counts], marker="o", label=strategy)
        right.plot([n for n in counts if n > 1], [direct[n] for n in counts if n > 1], marker="s", linestyle=":",
                   color="black", label="DDP all-reduce (no_sync, Accelerate loop)")
        for ax, label in ((left, "tokens/s"), (right, "communication share of a step")):
            ax.set_xticks(counts)
            ax.set_xlabel(f"processes ({CORES} cores)")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
        left.set_title(f"Scaling, micro-batch {micro} per process, {window_note(settings)}")
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        plt.close(fig)

    return text, chart


SECTIONS = {"configs": ("Throughput of every shipped config", section_configs),
            "peers": ("trainkit against the Hugging Face Trainer, a plain Accelerate loop and a bare PyTorch loop",
                      section_peers),
            "accum": ("Gradient accumulation at a fixed global batch", section_accum),
            "scaling": ("Scaling with the number of processes, and the communication share", section_scaling)}


# --- output --------------------------------------------------------------------------------------------------------


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{CORES} cores ({model})"


def versions() -> str:
    import accelerate
    import deepspeed
    import torch
    import transformers

    return (f"Python {platform.python_version()}, torch {torch.__version__}, accelerate {accelerate.__version__}, "
            f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")


def write_section(settings: Settings, name: str, body: str, png: Path, seconds: float) -> None:
    title = SECTIONS[name][0]
    start, end = f"<!-- throughput {name}: written by bench/throughput.py -->", f"<!-- end of throughput {name} -->"
    command = (f"python bench/throughput.py --section {name}" + (" --quick" if settings.quick else "")
               + (f" --repeats {settings.repeats}" if name == "peers" and settings.repeats != REPEATS else "")
               + (f" --peer_strategies {','.join(settings.peer_strategies)}" if name == "peers" and
                  settings.peer_strategies else ""))
    image = os.path.relpath(png, settings.markdown.parent)
    section = (f"{start}\n## {title}\n\n"
               f"Command: `{command}` ({settings.steps} optimizer steps per run, evaluation only at the end, "
               f"throughput the median of {settings.window}; the section took {seconds / 60:.1f} min). "
               f"Machine: {machine()}, CPU only. {versions()}. Measured {date.today().isoformat()}."
               + (" **Quick run: few configs and steps, a check that it works, not a measurement.**"
                  if settings.quick else "") + f"\n\n{body}\n\n![{name}]({image})\n{end}")
    replace_section(section, start, end, settings.markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=[*SECTIONS, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="peers: runs of each tool, taken in turn (this machine varies by up to 30%% from run to "
                        "run); the median counts")
    parser.add_argument("--quick", action="store_true", help="a few configs, 8 steps: a check, not a measurement")
    parser.add_argument("--peer_strategies", default="",
                        help=f"peers: comma-separated, of {', '.join(PEER_STRATEGIES)} (default: all)")
    parser.add_argument("--markdown", type=Path, default=ROOT / "BENCHMARKS.md", help="the file the sections go to")
    parser.add_argument("--images", type=Path, default=ROOT / "docs" / "images", help="where the charts go")
    args = parser.parse_args()
    settings = Settings(8 if args.quick else 24, 4 if args.quick else 7, args.quick,
                        1 if args.quick else args.repeats, args.markdown.resolve(),
                        args.images.resolve(), tuple(s for s in args.peer_strategies.split(",") if s))
    import matplotlib

    matplotlib.use("Agg")
    settings.images.mkdir(parents=True, exist_ok=True)
    took = {}
    for name in SECTIONS if args.section == "all" else [args.section]:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            body, chart = SECTIONS[name][1](settings, Path(tmp))
        png = settings.images / f"throughput_{name}.png"
        chart(png)
        took[name] = time.perf_counter() - started
        write_section(settings, name, body, png, took[name])
        print(f"{name}: written to {settings.markdown} and {png} ({took[name] / 60:.1f} min)", flush=True)
    print("took: " + ", ".join(f"{name} {s / 60:.1f} min" for name, s in took.items()))


if __name__ == "__main__":
    main()
