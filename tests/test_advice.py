"""Advice that works when it is followed: each refusal below is made, its fix is applied as printed (read from the
error line by `followed`, never written here), and the command it gives runs or meets another problem, never the same
one again. Found before: a mixture weight that is not a number was called "without a weight" and the fix printed for
it (`...:abc:1`) was refused again; a mixture was advised to train without --streaming, which it needs."""

from __future__ import annotations

import re

import pytest

from conftest import assert_refused, launch


def followed(args: list[str], line: str) -> list[str]:
    """args changed as the error line's fix says: `did you mean NAME?` renames the flag the line names, `use|pass
    --FLAG VALUE` sets it, `drop --FLAG [VALUE]` and `start without --FLAG` remove it, `pass only one` keeps the first
    of the two it names, and a fix that ends in a value (`give every source a weight: A:1,B:1`, `use all-linear`)
    sets the flag the line names to it."""
    where = re.search(r"\((--\w+|config field \w+|command line)[^()]*\): ", line)  # "what (where): fix"
    fix, flag = line[where.end():], where.group(1)
    args = list(args)

    def without(name: str, value: str | None = None) -> list[str]:
        i = args.index(name)
        return args[:i] + args[i + 1 + (value is not None or i + 1 < len(args) and not args[i + 1].startswith("--")):]

    if named := re.match(r"did you mean (\w+)\?", fix):
        return [f"--{named.group(1)}" if a == flag else a for a in args]
    if dropped := re.match(r"(?:drop|start without) (--\w+)(?: (\w+))?", fix):
        return without(dropped.group(1), dropped.group(2))
    if fix.startswith("pass only one"):  # of the two the problem names: keep the first
        return without(re.findall(r"--\w+", line)[1])
    if given := re.match(r"(?:use|pass) (--\w+) (\S+?)[,;:]?(?: |$)", fix):
        name, value = given.groups()
        return [*without(name), name, value] if name in args else [*args, name, value]
    value = re.split(r"[: ]", fix)[-1].rstrip(".")
    assert flag in args, (flag, line)
    return [value if i and args[i - 1] == flag else a for i, a in enumerate(args)]


def errors(stderr: str) -> list[str]:
    return [line.removeprefix("error: ") for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture
def sources(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("".join(f"line {i} of {name}\n" for i in range(40)))
    return tmp_path


CASES = {
    "a typo in a field": (["--recipe", "mlp", "--max_stepz", "3"], "did you mean max_steps?"),
    "a weight that is not a number": (["--data", "{a}:abc,{b}:1"], "give every source a weight"),
    "a mixture not streamed": (["--data", "{a}:1,{b}:1", "--streaming", "false"], "drop --streaming false"),
    "no checkpoint to resume": (["--recipe", "mlp", "--resume", "latest"], "start without --resume"),
    "two contradicting flags": (["--recipe", "mlp", "--resume", "auto", "--overwrite"], "pass only one"),
    "a loss average unknown": (["--loss_average", "mean"], "use --loss_average tokens"),
    "a train_on unknown": (["--train_on", "everything"], "use --train_on answers"),
    "an architecture unknown": (["--recipe", "tiny_transformer", "--arch", "gpt3"], "use --arch llama"),
    "a batch size of 0": (["--recipe", "mlp", "--batch_size", "0"], "pass --batch_size 1 or more"),
    "LoRA on modules the model lacks": (["--lora_r", "8", "--lora_target_modules", "foo"], "use all-linear"),
    "a held-out fraction out of range": (["--eval_fraction", "2"], "use --eval_fraction 0.05"),
    "a tokenizer not the saved one": (["--tokenizer", ""], "pass --tokenizer saved"),  # the default: checked
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_fix_followed_as_printed_gets_past_its_problem(check_only, chat, sources, tmp_path, case):
    folder, data = chat
    args, fix = CASES[case]
    args = [a.format(a=sources / "a.txt", b=sources / "b.txt") for a in args]
    if "--recipe" not in args:  # the fine-tuning recipe, on the chat data unless the case names its own
        args = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--chat_template", "chatml",
                *([] if "--tokenizer" in args else ["--tokenizer", "saved"]),
                *([] if "--data" in args else ["--data", str(data)]), *args]
    refused = check_only(tmp_path / "out", *args, "--dry_run")
    assert_refused(refused, fix)
    line = next(line for line in errors(refused.stderr) if fix in line)
    again = check_only(tmp_path / "out", *followed(args, line), "--dry_run")
    assert again.returncode == 0 or line not in errors(again.stderr), (line, again.stderr)
    assert again.returncode == 0, again.stderr  # here every fix leads to a run: nothing else is wrong


def test_a_folder_that_holds_a_run_is_continued_or_replaced_as_advised(check_only, tmp_path):
    out = tmp_path / "out"
    launch(out, "--recipe", "mlp", "--max_steps", "4", "--stop_at", "2", "--save_every", "1").check()
    refused = check_only(out, "--recipe", "mlp", "--max_steps", "4", "--dry_run")
    assert_refused(refused, "pass --resume latest to continue it, --overwrite to replace it")
    line = errors(refused.stderr)[0]
    assert check_only(out, *followed(["--recipe", "mlp", "--max_steps", "4"], line), "--dry_run").returncode == 0
