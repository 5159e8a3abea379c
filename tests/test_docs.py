"""Every command that README.md, docs/ and recipes/README.md print runs as printed, so that a page cannot rot.

A command is taken from the pages' code blocks (continuation lines joined) and from inline code that is a whole
command (one without a placeholder such as NAME, <path> or ...). Each runs from the repository root, with a limit on
its training steps and an output folder of its own, two at a time (a resume, or a plot of earlier runs, after the
commands of its page that it reads). What cannot run here (another machine, the network, the user's own recipe) is
listed in NOT_HERE with the reason and where it is covered; every other command runs, so a new page's example is
run from the day it is written.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest
from helpers import forked_launch

from conftest import ROOT, SERVER_ENV, TEST_ENV, forkable, forked_run_config

PAGES = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTS = ("python train.py", "accelerate launch", "python -m trainkit.")
PLACEHOLDER = re.compile(r"\.\.\.|<|\b[A-Z][A-Z_]{2,}\b|\b(N|K|R)\b|my_model")

# Commands the pages print that need what this machine lacks; each is covered where the reason says.
NOT_HERE = {
    "--main_process_ip 10.0.0.1": "two machines at 10.0.0.1 and beside it (tests/test_multinode.py runs "
                                  "multinode.yaml as two launches on loopback)",
    "accelerate_configs/deepspeed_hostfile.yaml": "the machines that ./hostfile lists, over ssh "
                                                  "(tests/test_multinode.py runs the hostfile launch and its dry run "
                                                  "against an sshd on loopback)",
    "Qwen/": "the network: a Hub model downloads (tests/test_recipes.py fine-tunes local models under every config)",
    "web/*.jsonl.gz": "the user's own corpus (tests/test_stream.py streams generated shards of every format, and "
                      "mixtures of them, on 1, 2 and 4 processes and 2 machines)",
    "--data mix.yaml": "the user's own mixture file (tests/test_stream.py reads a YAML mixture with a text field per "
                       "source)",
    "accelerate_configs/fsdp_cp.yaml": "GPUs: torch's ring attention has CUDA kernels only "
                                       "(tests/test_context_parallel.py runs it with a CPU stand-in for them, "
                                       "tests/test_gpu.py on 2 GPUs)",
    "my_model": "the user's own recipe file (tests/test_recipes.py copies one with trainkit.tools.catalog and runs "
                "these steps on it)",
}
# What a training command gets on top of what the page prints: few steps, with an evaluation among them.
LIMIT = ["--max_steps", "2", "--eval_every", "2", "--report_to", "none"]


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) in page order: code blocks, then whole inline commands."""
    found = []
    for page in PAGES:
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.split(" # ")[0].strip()
                line = line.split("&& ", 1)[-1]  # the README's set-up: pip install ... && <the main job>
                if line.startswith(STARTS):
                    found.append((name, " ".join(line.split())))
        prose = re.sub(r"\s*\n\s*", " ", re.sub(r"```.*?```", "", text, flags=re.S))
        for inline in re.findall(r"`((?:python train\.py|accelerate launch|python -m trainkit\.)[^`]*)`", prose):
            whole = "--recipe" in inline or inline.startswith("python -m trainkit.tools.catalog")
            if whole and not PLACEHOLDER.search(inline):
                found.append((name, " ".join(inline.split())))
    first = {}  # a command printed on several pages runs once, on the first
    for page, command in found:
        first.setdefault(command, page)
    return [(page, command) for command, page in first.items()]


def runs_training(args: list[str]) -> bool:
    return "train.py" in args and not {"--dry_run", "--estimate"} & set(args)


# Recipes that tests/test_strategies.py trains under every shipped config (parity, resume, export): a page's command
# that trains one of them under a shipped YAML is checked with --dry_run, which runs every check the launch runs
# (the recipe, its flags, the YAML, this machine) and trains nothing.
TRAINED_ELSEWHERE = ("mlp", "tiny_transformer")


def dry_run_instead(command: str, args: list[str], read_later: bool) -> list[str] | None:
    """`python train.py ARGS --dry_run [--accelerate_config YAML --num_processes N]` for a training command whose
    recipe and config the suite trains elsewhere, where no later command of its page reads what it writes; None for
    one that must run: the README's main job (its real console script), a launch with launcher flags that a dry run
    does not take (--mixed_precision, --max_restarts), a resume, any other recipe."""
    if not runs_training(args) or read_later or "--resume" in args or command == COMMANDS[0][1]:
        return None
    if "--recipe" not in args or args[args.index("--recipe") + 1] not in TRAINED_ELSEWHERE:
        return None
    cut = args.index("train.py")
    if args[:cut] == ["python"]:
        return [*args, "--dry_run"]
    launcher = dict(zip(args[2:cut:2], args[3:cut:2], strict=True))
    if args[:2] != ["accelerate", "launch"] or set(launcher) - {"--config_file", "--num_processes"}:
        return None
    world = ["--num_processes", launcher["--num_processes"]] if "--num_processes" in launcher else []
    return ["python", "train.py", *args[cut + 1:], "--dry_run", "--accelerate_config", launcher["--config_file"],
            *world]


def prepared(page_commands: list[str], tmp: Path) -> list[tuple[str, list[str] | None, str]]:
    """(command, argv or None, why not) for one page's commands, in order."""
    tmp.mkdir(parents=True, exist_ok=True)
    last_dir, result = None, []
    for i, command in enumerate(page_commands):
        reason = next((why for key, why in NOT_HERE.items() if key in command), None)
        if reason:
            result.append((command, None, reason))
            continue
        args = shlex.split(command.replace("/tmp/", f"{tmp}/"))
        for j, arg in enumerate(args):
            made = re.fullmatch(r"runs/(\w+)/final", arg)  # an earlier page's run: made here once, briefly
            if made and not (tmp / f"made_{made.group(1)}" / "final").is_dir():
                subprocess.run(["python", "train.py", "--recipe", made.group(1), "--output_dir",
                                str(tmp / f"made_{made.group(1)}"),
                                "--max_steps", "2", "--report_to", "none"], cwd=ROOT, env={**os.environ, **TEST_ENV},
                               check=True, capture_output=True)
            if made:
                args[j] = str(tmp / f"made_{made.group(1)}" / "final")
            if j and args[j - 1] == "--png":  # pictures go to the test's folder, not the repository
                args[j] = str(tmp / Path(arg).name)
        if "train.py" in args:
            resumes = "--resume" in args
            if "--output_dir" not in args:
                last_dir = last_dir if resumes and last_dir else tmp / f"run{i}"
                args += ["--output_dir", str(last_dir)]
            printed = command.split("--output_dir ", 1)[1].split()[0] if "--output_dir " in command else None
            read_later = any("--resume" in c or printed and printed in c for c in page_commands[i + 1:])
            if (checked := dry_run_instead(command, args, read_later)) is not None:
                result.append((command, checked, ""))
                continue
            if runs_training(args):
                resumed_later = any("--resume" in later for later in page_commands[i + 1:])
                args += ["--max_steps", "4"] if resumes else [*LIMIT, *(["--stop_at", "2"] if resumed_later else [])]
        if args[:3] == ["python", "-m", "trainkit.tools.compare"] and "--png" not in args:
            cut = args.index("--") if "--" in args else len(args)  # after "--" come train.py's flags
            args[cut:cut] = ["--png", str(tmp / "loss_curves.png")]
        result.append((command, args, ""))
    return result


def chains(prepared_page: list[tuple[str, list[str] | None, str]]) -> list[list[tuple[str, list[str]]]]:
    """A page's runnable commands as chains that may run beside each other: a command that reads what an earlier
    one wrote (a resume, a plot of earlier runs) joins the chains of those before it on its page."""
    result: list[list[tuple[str, list[str]]]] = []
    written: list[str] = []  # the output folders of the page's commands so far
    for command, args, _ in prepared_page:
        if args is None:
            continue
        reads = any(arg.startswith(folder) for arg in args for folder in written)  # trainkit.tools.ask /tmp/chat/final
        if reads or "--resume" in args or args[:3] == ["python", "-m", "trainkit.tools.plot"]:
            result = [[step for chain in result for step in chain] + [(command, args)]]
        else:
            result.append([(command, args)])
        if "--output_dir" in args:
            written.append(args[args.index("--output_dir") + 1] + "/")
        if args[:3] == ["python", "-m", "trainkit.tools.upcycle"]:  # the model folder it writes (no final/ in it)
            written.append(args[4])
    return result


def side_by_side(args: list[str]) -> list[str]:
    """Two launches at once on one machine need a port each: `--main_process_port 0`, as the README says."""
    return [*args[:2], "--main_process_port", "0", *args[2:]] if args[:2] == ["accelerate", "launch"] else args


def run(command: str, args: list[str]) -> tuple[int, str]:
    """(exit status, output) of one command. `accelerate launch ARGS` is Accelerate's console script calling
    accelerate.commands.launch's main on ARGS: it runs so, with the launcher and its ranks forked
    (tests/helpers/forked_launch.py), as does `python train.py ARGS`; but the README's main job runs through the
    script itself, and a launch whose rank reads its launcher's command line as itself (tests/helpers/launching.py's
    forkable).
    `python -m trainkit.tools.ask ARGS` and `trainkit.tools.compare ARGS` run the module's main on ARGS in this
    process, as its `__main__` block does, without a new interpreter's imports (compare's runs launched as above);
    tests/test_lora.py runs ask as the console command, from another folder."""
    if args[:3] in (["python", "-m", "trainkit.tools.ask"], ["python", "-m", "trainkit.tools.compare"]):
        import importlib

        return importlib.import_module(args[2]).main(args[3:]), "(its output and errors printed above)"
    args = side_by_side(args)
    env = {**os.environ, **TEST_ENV}
    config = args[args.index("--config_file") + 1] if "--config_file" in args else None
    if args[:2] == ["accelerate", "launch"] and command != COMMANDS[0][1] and config and forkable(config):
        code, out, err = forked_launch.launch(args[2:], ROOT, env, 600, SERVER_ENV)
        return code, out + err
    if args[:2] == ["python", "train.py"] and forkable(None):
        code, out, err = forked_launch.train(args[2:], ROOT, env, 600, SERVER_ENV)
        return code, out + err
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def run_chain(chain: list[tuple[str, list[str]]]) -> list[str]:
    failures = []
    for command, args in chain:
        started = time.perf_counter()
        code, output = run(command, args)
        print(f"\nexit {code} after {time.perf_counter() - started:.1f} s: {shlex.join(args)}")
        if code != 0:
            said = [line for line in output.splitlines() if "error" in line or "FAILED" in line]
            failures.append(f"{command}\n  -> exit {code}: {said or output[-1500:]}")
            break  # what comes after it on its chain reads what it did not write
    return failures


COMMANDS = documented_commands()
BY_PAGE = {page: [c for p, c in COMMANDS if p == page] for page, _ in COMMANDS}


def test_autoeps_presets_are_the_ones_deepspeed_has():
    """docs/recipes.md lists AutoEP's presets as the installed DeepSpeed registers them (it listed Qwen2-MoE, which
    DeepSpeed 0.19.8 has no preset for)."""
    import re

    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    page = (ROOT / "docs" / "recipes.md").read_text()
    listed = page[page.index("DeepSpeed 0.19.8 has "):].split(": no ")[0]
    assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(PRESET_MODELS)


def test_the_pages_print_commands_to_run():
    assert len(COMMANDS) >= 30 and {p for p, _ in COMMANDS} >= {"README.md", "docs/strategies.md",
                                                                "docs/model-parallelism.md"}


@pytest.mark.slow
def test_every_documented_command_runs_as_printed(tmp_path):
    """Two at a time (each launch spends most of its seconds starting Python processes, one core each)."""
    from concurrent.futures import ThreadPoolExecutor

    work = []
    for i, page in enumerate(sorted(BY_PAGE)):
        prepared_page = prepared(BY_PAGE[page], tmp_path / f"page{i}")
        for command, _, reason in prepared_page:
            if reason:
                print(f"\nnot run here ({page}): {command}: needs {reason}")
        work += chains(prepared_page)
    work.sort(key=len, reverse=True)  # the long chains first: the two lanes end together
    with ThreadPoolExecutor(max_workers=2) as lanes, mock.patch("trainkit.tools.compare.run_config",
                                                                forked_run_config):
        failures = [f for found in lanes.map(run_chain, work) for f in found]
    assert not failures, "\n".join(failures)
