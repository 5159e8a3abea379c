"""The machine's compute: how many CPU threads each process uses, and the peak FLOP/s that MFU is measured against.

Threads. `accelerate launch` sets OMP_NUM_THREADS in every process it starts (accelerate/utils/launch.py, from
`--num_cpu_threads_per_process`, which accelerate/commands/launch.py defaults to the launcher's own OMP_NUM_THREADS
or 1; only a YAML with `use_cpu: true` gets cores / processes instead), and torchrun sets it to 1 when it starts more
than one process. Our YAMLs say `use_cpu: false` (right for GPUs), so on a machine without GPUs every launched
process would compute on one core. The process cannot tell that 1 from a user's own `--num_cpu_threads_per_process 1`
or `OMP_NUM_THREADS=1`: the environment is all it gets. So on a machine without GPUs: TRAINKIT_CPU_THREADS, if set,
is the count; otherwise an OMP_NUM_THREADS other than 1 is the user's and kept, and so is 1 without a launcher
(`python train.py`); otherwise (1 under a launcher, or unset) each process takes its share of the cores: cores /
processes on this machine. GPU machines are left exactly as the launcher set them.

torch.set_num_threads is called only to change the count: it also pins MKL to that many threads and turns off MKL's
own choice of fewer threads for small matrix products (`mkl_set_num_threads_local`, `mkl_set_dynamic(0)` in
torch's ParallelOpenMP.cpp), after which the tiny transformer's small products run on both threads and their
OpenMP barriers sleep and wake through the kernel: 4.5x the futex calls per second and a slower step than the same
process without the call, which is how the Trainer and a bare loop run (BENCHMARKS.md).

Peak. GPUs: the dense bf16 tensor-core peak from a table of known models. CPUs: measured here, per machine (CPU
model), thread count, dtype and torch version: the best rate of square matmuls (a second or two), cached as JSON in
the cache directory. A busy second lowers a measurement (114 to 206 GFLOP/s within minutes on a shared 2-core
machine), and a low peak would raise every MFU read against it, so the first PEAK_MEASUREMENTS runs each measure once
and the cache keeps the best; every later run reads it. `--peak_flops` overrides both.

Memory. A CPU run's activations and gradients are allocated and freed every step. glibc's malloc gives large blocks
back to the kernel when they are freed (mmap'd blocks, and the top of the heap once 128 KiB-256 KiB are free), so the
next step gets fresh pages, each zeroed by the kernel on first touch: measured on the tiny transformer, about 6,000
page faults and 14 ms of system time in a 150 ms step, during which the other OpenMP thread waits at its barrier.
keep_freed_memory keeps freed blocks up to 32 MiB (glibc's largest mmap threshold) in the heap and the heap's top
up to 2 GiB, as jemalloc or tcmalloc would: 0 faults per step, the same peak resident memory (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from trainkit.errors import ConfigError, Problem

THREADS_ENV = "TRAINKIT_CPU_THREADS"

# Dense bf16/fp16 tensor-core peaks (FLOP/s) of GPUs we know; MFU is reported against these.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}

CACHE_FILE = "cpu_peak_flops.json"
CPU_INFO_FILE = "cpu_info.json"  # py-cpuinfo's answer, per boot: remember_cpu_info
MATMUL_SIZES = (256, 512, 1024, 2048)  # square sizes tried, smallest first
SECONDS_PER_SIZE = 0.25  # repetitions of one size, after a warm-up product
PEAK_MEASUREMENTS = 3  # runs that measure a CPU's peak, at different times; the best counts


@dataclass(frozen=True, slots=True)
class CpuThreads:
    """Intra-op threads for this process, and why that many (for the run's note and resolved_config.json)."""

    count: int
    source: str
    shares_cores: bool = False  # the runner's share of the cores, not a count the user gave


def cpu_cores() -> int:
    """Physical cores this process may run on: the machine's (hyper-threads share a core's matmul units) within its
    CPU affinity (a container's cpuset)."""
    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else physical  # Linux only
    return max(1, min(physical, allowed))


def local_processes(env: Mapping[str, str]) -> int:
    """Processes of this launch on this machine: torchrun's LOCAL_WORLD_SIZE, DeepSpeed launcher's LOCAL_SIZE."""
    return max(1, int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1))


def choose_cpu_threads(env: Mapping[str, str], cores: int) -> CpuThreads:
    """The thread count on a machine without GPUs (the rule in this module's docstring)."""
    if THREADS_ENV in env:
        return CpuThreads(_positive(env[THREADS_ENV], THREADS_ENV), THREADS_ENV)
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp and not (_under_launcher(env) and omp == "1"):
        return CpuThreads(_positive(omp, "OMP_NUM_THREADS"), "OMP_NUM_THREADS")
    processes = local_processes(env)
    return CpuThreads(max(1, cores // processes), f"{cores} cores / {processes} process(es) on this machine", True)


def _under_launcher(env: Mapping[str, str]) -> bool:
    """Started by a launcher: torchrun and DeepSpeed's launcher set LOCAL_RANK; `accelerate launch` of one process (no
    torchrun) sets its ACCELERATE_* variables only; `python train.py` neither."""
    return "LOCAL_RANK" in env or "ACCELERATE_MIXED_PRECISION" in env


def narrowed_affinity(allowed: set[int], machine_cpus: int, env: Mapping[str, str], threads: CpuThreads) -> str | None:
    """The run's note when this process may run on fewer CPUs than the machine has, with the likely cause.

    OMP_PROC_BIND is the usual one: OpenMP binds the importing thread to the first core when torch is imported. Under
    a launch the launcher imports torch too, so every process it starts inherits that one core (measured here: DDP
    on 2 cores with OMP_PROC_BIND=close, both ranks on core 0, 4.9k tokens/s against 13k). Without a launcher only
    this process's main thread is bound: OpenMP binds its other threads to the other cores, but the cores counted
    for the thread count (cpu_cores) are the main thread's one, unless the user gave the count (`threads`)."""
    if len(allowed) >= machine_cpus:
        return None
    cpus = ",".join(map(str, sorted(allowed)))
    where = f"this process may run only on CPU(s) {cpus} of this machine's {machine_cpus}"
    if "OMP_PROC_BIND" not in env:
        return f"{where} (its CPU affinity: taskset, numactl or a container's cpuset)"
    bind = f"OMP_PROC_BIND={env['OMP_PROC_BIND']}"
    if _under_launcher(env):
        return f"{where}: {bind} bound the launcher to one core and every process it starts inherited it; unset " \
               "OMP_PROC_BIND before `accelerate launch`"
    if not threads.shares_cores:
        return None  # the count is the user's; OpenMP puts one thread on each core
    return f"{bind} bound this process's first thread to CPU(s) {cpus} as torch was imported, so {len(allowed)} " \
           f"of the machine's {machine_cpus} CPUs were counted for its threads: set OMP_NUM_THREADS to the count " \
           "you want"


def _positive(value: str, name: str) -> int:
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError([Problem(f"{name}={value!r} is not a positive number of threads",
                                   f"the environment variable {name}",
                                   f"set {name} to e.g. {cpu_cores()}, or unset it for one share of the cores per "
                                   "process")])
    return count


def use_cpu_threads() -> CpuThreads | None:
    """Set this process's torch threads by the rule above, and keep its freed memory (keep_freed_memory); None
    (nothing changed) on a machine with GPUs."""
    if torch.cuda.is_available():
        return None
    threads = choose_cpu_threads(os.environ, cpu_cores())
    if torch.get_num_threads() != threads.count:  # only a change: the call also fixes MKL's thread count (below)
        torch.set_num_threads(threads.count)
    keep_freed_memory()
    return threads


MALLOC_MMAP_LIMIT = 32 * 2**20  # glibc's largest M_MMAP_THRESHOLD on 64-bit machines: blocks up to it stay in the heap
MALLOC_TRIM_LIMIT = 2**31 - 1  # M_TRIM_THRESHOLD: free memory at the heap's top up to 2 GiB is kept (an int)


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed blocks for the next step instead of returning them to the kernel (the module
    docstring says why). False where the C library is not glibc (nothing changed)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(-3, MALLOC_MMAP_LIMIT) and mallopt(-1, MALLOC_TRIM_LIMIT))  # M_MMAP_, M_TRIM_THRESHOLD


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def measure_matmul_peak(dtype: torch.dtype) -> float:
    """The best FLOP/s of square matmuls (2 n^3 FLOPs each) with torch's current threads: each size in turn, the best
    of its repetitions (at least two, for a quarter second), up to the first size whose one product would take more
    than a quarter second (small sizes leave many cores idle, large ones leave the caches). About a second."""
    best = 0.0
    for n in MATMUL_SIZES:
        if best and 2 * n ** 3 / best > SECONDS_PER_SIZE:
            break
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warm-up: thread pool, packing buffers
        times: list[float] = []
        deadline = time.perf_counter() + SECONDS_PER_SIZE
        while len(times) < 2 or time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        best = max(best, 2 * n ** 3 / min(times))
    return best


def cpu_peak_flops(dtype: torch.dtype, cache_dir: Path, may_measure: bool = True) -> tuple[float, bool]:
    """This CPU's matmul peak at torch's current thread count, and whether it was measured now (False: read from the
    cache). The cache is keyed by CPU model, threads, dtype and torch version, and keeps the best of the first
    PEAK_MEASUREMENTS measurements (`may_measure=False`: read it as it is, as a launch's other processes do once its
    first one has measured); it is rewritten under a temporary name and renamed, so a reader never sees half a file
    (two machines sharing the cache at worst measure once more)."""
    key = f"{cpu_model()} | {torch.get_num_threads()} threads | {str(dtype).removeprefix('torch.')} | " \
          f"torch {torch.__version__}"
    path = cache_dir / CACHE_FILE
    entry = _peak_entry(_read_cache(path), key)
    if entry and (entry["measurements"] >= PEAK_MEASUREMENTS or not may_measure):
        return entry["flops"], False
    flops = measure_matmul_peak(dtype)
    cache = _read_cache(path)  # again: another run may have added its keys meanwhile
    entry = _peak_entry(cache, key) or {"flops": 0.0, "measurements": 0}
    cache[key] = {"flops": max(flops, entry["flops"]), "measurements": entry["measurements"] + 1,
                  "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write_cache(path, cache)
    return cache[key]["flops"], True


def _peak_entry(cache: dict, key: str) -> dict | None:
    """The cache's entry for `key` as {"flops", "measurements"}, or None when it has none that reads (a file from
    before the count was kept held one measurement)."""
    entry = cache.get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("flops"), (int, float)) or entry["flops"] <= 0:
        return None
    count = entry.get("measurements", 1)
    return {"flops": float(entry["flops"]), "measurements": count if isinstance(count, int) else 1}


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or damaged by hand: measure again
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict) -> None:
    """Under a temporary name, then renamed: a reader never sees half a file. A cache that cannot be written (a full
    disk) is not written: the next run measures again, and the run's own writers name the disk if it matters."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)


def remember_cpu_info(cache_dir: Path) -> None:
    """From here on, py-cpuinfo's `get_cpu_info` answers from cache_dir after its first answer on this boot.

    DeepSpeed's CPU Adam (the ZeRO-Offload configs) asks it three times in every process (deepspeed/ops/adam/
    cpu_adam.py, then its op builder's cpu_arch and simd_width), and py-cpuinfo answers each time from new Python
    processes that probe CPUID and time the clock for a second: about 5 s of each offload launch on 2 cores. What
    DeepSpeed reads (vendor, architecture, SIMD flags) cannot change while the machine runs, so the answer is kept with
    the boot's id: after a reboot, or on another machine that shares the cache, it is asked again."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed's op builder then reads lscpu itself
        return
    ask = getattr(cpuinfo.get_cpu_info, "__wrapped__", cpuinfo.get_cpu_info)
    path, boot = cache_dir / CPU_INFO_FILE, _boot_id()

    @functools.wraps(ask)
    def get_cpu_info() -> dict:
        cached = _read_cache(path)
        if boot and cached.get("boot_id") == boot and isinstance(cached.get("info"), dict):
            return cached["info"]
        info = ask()
        if boot and info:  # py-cpuinfo answers {} when its probe failed: ask again next time
            _write_cache(path, {"boot_id": boot, "info": info})
        return info

    cpuinfo.get_cpu_info = get_cpu_info


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()  # Linux
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class Peak:
    """The peak FLOP/s of one process's device (None: unknown) and where it came from."""

    flops: float | None
    source: str


def device_peak_flops(device: torch.device, mixed_precision: str, override: float | None, cache_dir: Path,
                      may_measure: bool = True) -> Peak:
    """The peak MFU is measured against: --peak_flops; a known GPU's dense bf16 peak; on CPU the measured matmul peak
    in the dtype the matmuls run in (bf16 under bf16 autocast, else fp32) with this process's threads."""
    if override:
        return Peak(override, "--peak_flops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        flops = next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
        return Peak(flops, f"the {name}'s dense bf16 peak (a table of known GPUs)" if flops else
                    f"unknown for the {name}: pass --peak_flops for MFU")
    if device.type == "cpu":
        dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
        flops, measured = cpu_peak_flops(dtype, cache_dir, may_measure)
        return Peak(flops, f"{'measured now' if measured else 'measured earlier'}: {cpu_model()}, "
                           f"{str(dtype).removeprefix('torch.')} matmul, {torch.get_num_threads()} thread(s); "
                           f"cached in {cache_dir / CACHE_FILE}, which keeps the best of the first "
                           f"{PEAK_MEASUREMENTS} runs' measurements")
    return Peak(None, f"unknown for {device.type} devices: pass --peak_flops for MFU")


@dataclass(frozen=True, slots=True)
class Compute:
    """This process's compute as the run uses it: its CPU threads (None on GPU machines: untouched) and its device's
    peak."""

    threads: CpuThreads | None
    peak: Peak
    affinity: str | None = None  # narrowed_affinity's note

    @classmethod
    def set_up(cls, accelerator, mixed_precision: str, override: float | None, cache_dir: Path) -> Compute:
        """Set this process's CPU threads, then find its device's peak; on a CPU one process per machine measures
        it (with its own threads: every process of a launch gets the same count) and the others read the cache.
        What py-cpuinfo says of the CPU is cached there too (remember_cpu_info)."""
        threads = use_cpu_threads()
        remember_cpu_info(cache_dir)
        with accelerator.local_main_process_first():
            peak = device_peak_flops(accelerator.device, mixed_precision, override, cache_dir,
                                     accelerator.is_local_main_process)
        affinity = narrowed_affinity(os.sched_getaffinity(0), os.cpu_count() or 1, os.environ, threads) \
            if threads and hasattr(os, "sched_getaffinity") else None  # Linux; GPU machines are left alone
        return cls(threads, peak, affinity)

    def notes(self) -> list[str]:
        lines = []
        if self.threads:
            other = "" if self.threads.source == THREADS_ENV else f"; {THREADS_ENV} sets another count"
            lines.append(f"{self.threads.count} CPU thread(s) per process ({self.threads.source}{other})")
        if self.affinity:
            lines.append(self.affinity)
        if self.peak.flops:
            lines.append(f"MFU against a peak of {self.peak.flops / 1e9:,.1f} GFLOP/s per process ({self.peak.source})")
        else:
            lines.append(f"no MFU: peak FLOP/s {self.peak.source}")
        return lines

    def resolved(self, planned: Mapping[str, Any]) -> dict[str, Any]:
        """The plan's resolved config with the machine's `cpu_threads` (null on GPU machines) and `peak_flops` (per
        process) and their sources; `sources` stays the last key."""
        resolved = {key: value for key, value in planned.items() if key != "sources"}
        resolved["cpu_threads"] = self.threads.count if self.threads else None
        resolved["peak_flops"] = self.peak.flops
        resolved["sources"] = {**planned.get("sources", {}), "cpu_threads": self.threads.source if self.threads else
                               "the launcher (a GPU machine: left as it is)", "peak_flops": self.peak.source}
        return resolved
