"""One run of train.py that measures each rank's peak of live tensor bytes in a training step: what
torch.cuda.max_memory_allocated reports on a GPU, measured on a CPU (a process's resident memory would count the
interpreter, the libraries and the data too).

    accelerate launch --config_file accelerate_configs/deepspeed_zero3_sp.yaml bench/live_peak.py PEAKS train.py-flags

The peak is the model state the rank holds as its second step begins (every tensor of the model and the optimizer,
metrics.py's state_bytes, as train.py's state_bytes counts them) plus the most that live tensors grow over that step
(every allocation and free torch.profiler records, as a GPU's allocator counts them; torch's memory timeline, which
trainkit/estimate.py's measured_activations reads, cannot place DeepSpeed's operators: "version mismatch"): the
activations, the gradients, the loss's logits, the collectives' buffers. Memory that tensors made before the step free
during it is not subtracted. The first step is left out: it also makes the optimizer's states, once.
Each rank writes PEAKS/rank<R>.json: {"held": bytes, "step": bytes, "exit": train.main's exit code}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.profiler._memory_profiler import _EventType  # noqa: E402

import train  # noqa: E402
from trainkit.run.metrics import state_bytes  # noqa: E402

MEASURED_STEP = 2


def growth(prof: profile) -> int:
    """The most that the bytes allocated inside the profiled window and not yet freed ever reached."""
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    live, peak, sizes = 0, 0, {}
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        if size > 0:
            sizes[ptr] = size
        elif ptr not in sizes:
            continue  # made before the window
        else:
            del sizes[ptr]
        live += size
        peak = max(peak, live)
    return peak


def main() -> None:
    peaks, flags = Path(sys.argv[1]), sys.argv[2:]
    measured: dict[str, int] = {}
    train_step = train.train_step

    def profiled(engine, step, *args, **kwargs):
        if step != MEASURED_STEP:
            return train_step(engine, step, *args, **kwargs)
        measured["held"] = state_bytes(engine.state_tensors())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = train_step(engine, step, *args, **kwargs)
        measured["step"] = growth(prof)
        return result

    train.train_step = profiled  # train.loop calls it by its name in train.py
    code = train.main(flags)
    peaks.mkdir(parents=True, exist_ok=True)
    (peaks / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({**measured, "exit": code}))
    sys.exit(code)


if __name__ == "__main__":
    main()
