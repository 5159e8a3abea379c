"""What checkpoint checksums cost: hashing every file at save, and checking it at load; BENCHMARKS.md.

    python bench/checksums.py               # about 2 minutes on 2 quiet CPU cores
    python bench/checksums.py --repeats 5

One process holds a model of 100M fp32 parameters and AdamW's two moments (a 1.2 GB checkpoint, the size of
bench/async_save.py's larger case) and, REPEATS times in turn:
- writes it with torch.distributed.checkpoint, as trainkit/strategies/dcp_format.py does (`dcp.save`, which flushes
  every file to disk), then lists the folder as the save does (trainkit/run/checkpoint.py's _file_table: size and
  xxh3_64 of every file, read back from the page cache);
- checks the folder as a resume does before loading (_damage: every size, then every digest), then loads it
  (`dcp.load`).
The ratios hash / write and check / load are taken within each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import replace_section  # noqa: E402

from trainkit.run.checkpoint import _damage, _file_table  # noqa: E402

WIDTH, LAYERS = 2048, 24  # 24 x 2048 x 2048 = 100.7M parameters
START, END = "<!-- checksum table: written by bench/checksums.py -->", "<!-- end of checksum table -->"


def state() -> dict:
    """A model and its AdamW state after one step: what a checkpoint holds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def timed(call, *args) -> tuple[float, object]:
    started = time.perf_counter()
    result = call(*args)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()
    held = state()
    rows = ["| round | checkpoint (GB) | write (s) | hash (s) | hash / write | load (s) | check (s) | "
            "check / load |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    save_ratios, load_ratios = [], []
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # the repository's disk, where runs write by default
        for repeat in range(1, args.repeats + 1):
            folder = Path(tmp) / f"step_{repeat}"
            write_s, _ = timed(partial(dcp.save, held, checkpoint_id=str(folder)))
            hash_s, table = timed(_file_table, folder)
            check_s, damage = timed(_damage, folder, {"files": table})
            assert damage is None, damage
            load_s, _ = timed(partial(dcp.load, held, checkpoint_id=str(folder)))
            size = sum(entry["bytes"] for entry in table.values()) / 1e9
            save_ratios.append(hash_s / write_s)
            load_ratios.append(check_s / load_s)
            rows.append(f"| {repeat} | {size:.2f} | {write_s:.2f} | {hash_s:.2f} | {save_ratios[-1]:.2f} | "
                        f"{load_s:.2f} | {check_s:.2f} | {load_ratios[-1]:.2f} |")
            print(rows[-1], flush=True)
    summary = (f"hashing adds {min(save_ratios):.2f}-{max(save_ratios):.2f} of the write to a save (median "
               f"{statistics.median(save_ratios):.2f}); checking adds {min(load_ratios):.2f}-{max(load_ratios):.2f} "
               f"of the load to a resume (median {statistics.median(load_ratios):.2f})")
    section = (START + f"\n\n`python bench/checksums.py --repeats {args.repeats}`; load average before the run "
               f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min), one process on "
               f"{os.cpu_count()} cores.\n\n" + "\n".join(rows) + "\n\n" + summary + ".\n" + END)
    replace_section(section, START, END)
    print(summary)


if __name__ == "__main__":
    main()
