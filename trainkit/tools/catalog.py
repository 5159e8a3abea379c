"""The shipped recipes and configs: list them, and copy one into your own tree to make it yours.

    python -m trainkit.tools.catalog ls
    python -m trainkit.tools.catalog cp image_classifier my_images.py
    python -m trainkit.tools.catalog cp deepspeed_zero3 my_zero3.yaml

`ls` gives each with the first sentence of its description (a recipe's docstring, a YAML's header). `cp` copies a
recipe (a name from recipes/) or a config (a name from accelerate_configs/, or a DeepSpeed JSON from ds_configs/),
never over an existing file, and prints the command that runs the copy.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

from trainkit.launch.launcher import CONFIGS_DIR
from trainkit.recipes import RECIPES_DIR, ROOT, shipped_recipes

DS_CONFIGS_DIR = CONFIGS_DIR.parent / "ds_configs"


def first_sentence(paragraph: str) -> str:
    """A paragraph's first sentence, its lines joined: a description wrapped at the line length is not cut short."""
    text = " ".join(paragraph.split())
    return text.split(". ")[0].rstrip(".") + "." if text else ""


def recipe_summary(path: Path) -> str:
    """The first sentence of a recipe file's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return first_sentence(doc.strip().split("\n\n")[0])


def config_summary(path: Path) -> str:
    """The first sentence of a YAML's header comment, without the file's own name."""
    paragraph = []
    for line in path.read_text().splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or (paragraph and not text):
            break
        paragraph.append(text)
    return first_sentence(" ".join(paragraph).removeprefix(f"{path.name}:"))


def listing() -> str:
    recipes = {name: recipe_summary(RECIPES_DIR / f"{name}.py") for name in shipped_recipes()}
    configs = {p.stem: config_summary(p) for p in sorted(CONFIGS_DIR.glob("*.yaml"))}
    width = max(map(len, [*recipes, *configs])) + 2
    lines = ["Recipes (recipes/; python train.py --recipe NAME):"]
    lines += [f"  {name:<{width}}{text}" for name, text in recipes.items()]
    lines += ["", "Configs (accelerate_configs/; accelerate launch --config_file accelerate_configs/NAME.yaml "
                  "train.py --recipe ...):"]
    lines += [f"  {name:<{width}}{text}" for name, text in configs.items()]
    lines += ["", "Copy one to make it yours: python -m trainkit.tools.catalog cp NAME DESTINATION"]
    return "\n".join(lines)


def copy(name: str, destination: str) -> tuple[Path, str]:
    """Copy a shipped recipe, config or DeepSpeed JSON; returns the copy and the command that runs it.
    Raises ValueError with the message to print."""
    sources = {n: RECIPES_DIR / f"{n}.py" for n in shipped_recipes()}
    sources.update({p.stem: p for p in sorted(CONFIGS_DIR.glob("*.yaml"))})
    sources.update({p.name: p for p in sorted(DS_CONFIGS_DIR.glob("*.json"))})
    source = sources.get(name.removesuffix(".py").removesuffix(".yaml"), sources.get(name))
    if source is None:
        close = difflib.get_close_matches(name, list(sources), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "python -m trainkit.tools.catalog ls lists them"
        raise ValueError(f"no shipped recipe or config named {name!r}: {hint}")
    target = Path(destination).absolute()  # absolute, not resolved: a link is refused below, never followed
    if target.suffix != source.suffix:
        target = target.with_name(target.name + source.suffix)
    if target.exists() or target.is_symlink():
        raise ValueError(f"{target} already exists{' (a link)' if target.is_symlink() else ''}: refusing to "
                         f"overwrite it; choose another name")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "xb") as copied:  # exclusive: a link or file made meanwhile is not written through
        copied.write(source.read_bytes())
    # train.py and the configs' relative paths (ds_configs/...) are read from the repository's root
    here = "" if Path.cwd().resolve() == ROOT else f"cd {ROOT} && "
    if source.suffix == ".py":
        recipe = target.stem if target.resolve().parent == RECIPES_DIR else target  # in recipes/: by name
        run = (f"{here}python train.py --recipe {recipe} --dry_run    # then: accelerate launch --config_file "
               f"accelerate_configs/ddp.yaml train.py --recipe {recipe}")
    elif source.suffix == ".yaml":
        run = f"{here}accelerate launch --config_file {target} train.py --recipe mlp"
        if "deepspeed_config_file" in source.read_text():
            run += ("    # it names its DeepSpeed JSON in ds_configs/; to change that too: python -m "
                    "trainkit.tools.catalog cp <the json> mine.json, then point deepspeed_config_file at it")
    else:
        run = ("point deepspeed_config_file in a copy of a deepspeed_*.yaml at it, then: accelerate launch "
               "--config_file <that yaml> train.py --recipe mlp")
    return target, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainkit.tools.catalog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ls", help="list the shipped recipes and configs")
    cp = commands.add_parser("cp", help="copy a recipe or config to a new file")
    cp.add_argument("name", help="a recipe (mlp), a config (ddp) or a DeepSpeed JSON (zero2.json)")
    cp.add_argument("destination", help="the new file (.py for a recipe, .yaml for a config, .json for a JSON)")
    args = parser.parse_args(argv)
    if args.command == "ls":
        print(listing())
        return 0
    try:
        target, run = copy(args.name, args.destination)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"copied {args.name} to {target}\nrun it: {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
