"""python -m trainkit.tools.plot and trainkit.tools.compare's picture: what each panel holds, checked against the
metrics it was
drawn from (run folders written here, nothing launched); the refusals of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure

import trainkit.tools.compare
from trainkit.launch.train_process import Run
from trainkit.tools.plot import DIFF_FLOOR, main, plot_runs, read_run

MiB = 1024 ** 2


def write_run(folder: Path, losses: list[float | None], first_step: int = 1, resolved: dict | None = None,
              **extra: object) -> list[dict]:
    """A run folder as train.py leaves it: one metrics line per step (eval_loss on every 5th step) and, unless
    resolved is None, a resolved_config.json. `extra` adds keys to every line."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = []
    for i, loss in enumerate(losses):
        step = first_step + i
        line = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "samples_per_s": 1000.0 + 10 * step,
                "mfu": None, "state_bytes": 101_416, "peak_mem_bytes": 360 * MiB + 4096 * step, **extra}
        if step % 5 == 0:
            line["eval_loss"] = 0.9 * loss
        metrics.append(line)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if resolved is not None:
        (folder / "resolved_config.json").write_text(json.dumps(resolved))
    return metrics


def panel(figure: Figure, title: str) -> Axes:
    [ax] = [ax for ax in figure.axes if ax.get_title().startswith(title)]
    return ax


def column(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    return [m["step"] for m in metrics if key in m], [np.nan if m[key] is None else m[key] for m in metrics if key in m]


def assert_line(line, xs: list, ys: list) -> None:
    np.testing.assert_array_equal(line.get_xdata(), xs)
    np.testing.assert_allclose(line.get_ydata(), ys, rtol=1e-12, equal_nan=True)


LOSSES = [4.0, 3.0, 2.5, 2.0, 1.8, 1.6, 1.5, 1.4, 1.3, 1.25]


def test_each_panel_holds_the_runs_metrics(tmp_path):
    a = write_run(tmp_path / "a", LOSSES, resolved={"strategy": "single", "recipe": "/repo/recipes/mlp.py"})
    # equal on odd steps, 1e-7 apart on even ones, a non-finite loss (null) on step 3
    other = [x if i % 2 == 0 else x * (1 + 1e-7) for i, x in enumerate(LOSSES)]
    other[2] = None
    b = write_run(tmp_path / "b", other, resolved={"strategy": "ddp", "recipe": "/repo/recipes/mlp.py"})
    figure = plot_runs([read_run(tmp_path / "a"), read_run(tmp_path / "b")], "two runs")

    loss = figure.axes[0]  # trainkit.tools.compare's test relies on the loss panel coming first
    assert loss.get_title().startswith("training loss") and [ln.get_label() for ln in loss.lines] == ["single/mlp",
                                                                                                      "ddp/mlp"]
    for line, metrics in zip(loss.lines, [a, b], strict=True):
        assert_line(line, *column(metrics, "loss"))
    evals = [c.get_offsets() for c in loss.collections]  # eval_loss: points at the evaluation steps
    for points, metrics in zip(evals, [a, b], strict=True):
        np.testing.assert_allclose(points, np.array(column(metrics, "eval_loss")).T)

    for line, metrics in zip(panel(figure, "samples/s").lines, [a, b], strict=True):
        assert_line(line, *column(metrics, "samples_per_s"))

    mfu = panel(figure, "MFU")
    assert not mfu.lines and "mfu is null on every line" in mfu.texts[0].get_text()

    memory = panel(figure, "memory of rank 0 (MiB")
    assert [ln.get_label() for ln in memory.lines] == ["single/mlp: peak_mem_bytes", "single/mlp: state_bytes",
                                                       "ddp/mlp: peak_mem_bytes", "ddp/mlp: state_bytes"]
    for line, (metrics, key) in zip(memory.lines, [(a, "peak_mem_bytes"), (a, "state_bytes"), (b, "peak_mem_bytes"),
                                                   (b, "state_bytes")], strict=True):
        steps, values = column(metrics, key)
        assert_line(line, steps, [v / MiB for v in values])
    assert memory.get_yscale() == "log"

    difference = panel(figure, "|loss - reference|")
    floor, line = difference.lines  # the floor, then one line per run after the reference
    assert list(floor.get_ydata()) == [DIFF_FLOOR] * 2 and floor.get_label() == "equal losses, drawn at 1e-10"
    expected = {s: max(abs(x - y) / abs(y), DIFF_FLOOR) for s, x, y in zip(range(1, 11), other, LOSSES, strict=True)
                if x is not None}
    assert_line(line, list(expected), list(expected.values()))
    assert line.get_ydata()[0] == DIFF_FLOOR and line.get_ydata()[1] == pytest.approx(1e-7, rel=1e-6)
    assert difference.get_yscale() == "log" and f"equal losses drawn at {DIFF_FLOOR:.0e}" in difference.get_title()
    assert line.get_label() == "ddp/mlp (max 1.0e-07; 4 equal steps drawn at the floor)"  # step 3 is a gap


def test_a_short_run_has_whole_step_ticks(tmp_path):
    write_run(tmp_path / "a", LOSSES[:3])
    write_run(tmp_path / "b", LOSSES[:3])
    figure = plot_runs([read_run(tmp_path / "a"), read_run(tmp_path / "b")], "")
    for ax in figure.axes:
        if ax.lines:  # the MFU panel has none: mfu is null in these metrics
            low, high = ax.get_xlim()
            assert [t for t in ax.get_xticks() if low <= t <= high] == [1, 2, 3], (ax.get_title(), ax.get_xticks())


def test_tokens_per_s_and_mfu_in_percent_when_present(tmp_path):
    write_run(tmp_path / "lm", LOSSES, tokens_per_s=64_000.0, mfu=0.42)
    figure = plot_runs([read_run(tmp_path / "lm")], "")
    assert len(figure.axes) == 4  # one run: no difference panel
    [throughput] = panel(figure, "tokens/s").lines
    assert list(throughput.get_ydata()) == [64_000.0] * 10
    [mfu] = panel(figure, "MFU (%)").lines
    np.testing.assert_allclose(mfu.get_ydata(), [42.0] * 10)


def test_a_mixture_of_experts_shows_its_balancing_loss_and_expert_load(tmp_path):
    """A run that logs aux_loss and expert_load/layer_<i> gets a row with them (the layers in numeric order: 10 after
    2); a dense run beside it draws nothing there, and alone has no such row."""
    loads = {f"expert_load/layer_{i}": 1.5 + i / 10 for i in (0, 2, 10)}
    moe = write_run(tmp_path / "moe", LOSSES, resolved={"strategy": "fsdp_ep", "recipe": "causal_lm"}, aux_loss=2.01,
                    **loads)
    write_run(tmp_path / "dense", LOSSES, resolved={"strategy": "fsdp", "recipe": "causal_lm"})
    figure = plot_runs([read_run(tmp_path / "moe"), read_run(tmp_path / "dense")], "")
    [aux] = panel(figure, "router's balancing loss").lines
    assert_line(aux, *column(moe, "aux_loss"))
    load = panel(figure, "expert load")
    assert [ln.get_label() for ln in load.lines] == ["an even spread", *(f"fsdp_ep/causal_lm: layer {i}"
                                                                         for i in (0, 2, 10))]
    for line, key in zip(load.lines[1:4], loads, strict=True):
        assert_line(line, *column(moe, key))
    assert len(figure.axes) == 7  # loss, throughput, MFU, memory, the router's two, the difference
    assert len(plot_runs([read_run(tmp_path / "dense")], "").axes) == 4


def test_cli_writes_the_png_with_labels(tmp_path, capsys):
    same = {"strategy": "ddp", "recipe": "mlp.py"}
    write_run(tmp_path / "a", LOSSES, resolved=same)
    write_run(tmp_path / "b", LOSSES, resolved=same)
    write_run(tmp_path / "c", LOSSES)  # no resolved_config.json: the folder's name
    png = tmp_path / "out" / "runs.png"
    assert main([str(tmp_path / "a"), str(tmp_path / "c"), "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and f"plot of 2 run(s): {png}" in capsys.readouterr().out
    assert [r.label for r in (read_run(tmp_path / "a"), read_run(tmp_path / "c"))] == ["ddp/mlp", "c"]
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "one,two", "--png", str(png)]) == 0


def test_different_step_ranges_plot_the_shared_steps_and_say_so(tmp_path, capsys):
    write_run(tmp_path / "a", LOSSES)
    b = write_run(tmp_path / "b", LOSSES[4:] + [1.2, 1.1], first_step=5)  # steps 5-12 against 1-10
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--png", str(tmp_path / "runs.png")]) == 0
    assert f"note: {tmp_path / 'b'}: the difference panel shows steps 5-10" in capsys.readouterr().err
    figure = plot_runs([read_run(tmp_path / "a"), read_run(tmp_path / "b")], "")
    assert_line(figure.axes[0].lines[1], *column(b, "loss"))  # the loss panel keeps all of b
    _, line = panel(figure, "|loss - reference|").lines
    assert list(line.get_xdata()) == [5, 6, 7, 8, 9, 10] and set(line.get_ydata()) == {DIFF_FLOOR}
    assert "only the shared steps 5-10" in line.get_label()


@pytest.mark.parametrize("case, message", [
    ("missing", "error: no such run folder ({folder}): pass the --output_dir of a run"),
    ("no_metrics", "error: no metrics.jsonl in this folder ({folder}): pass a run's --output_dir"),
    ("empty", "error: metrics.jsonl is empty ({folder}): the run has not finished a step yet"),
    ("torn", "error: line 2 of metrics.jsonl is not JSON ({folder}): the run was stopped while writing it"),
    ("no_overlap", "error: no step with a loss in common with the reference {reference} (steps 20-21 against 1-10) "
                   "({folder}): put first the run to compare against"),
])
def test_bad_run_folders_are_refused(tmp_path, capsys, case, message):
    write_run(tmp_path / "ref", LOSSES)
    folder = tmp_path / case
    if case == "no_overlap":
        write_run(folder, [1.0, 0.9], first_step=20)
    elif case != "missing":
        folder.mkdir()
    if case == "empty":
        (folder / "metrics.jsonl").write_text("")
    if case == "torn":
        (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    png = tmp_path / "runs.png"
    assert main([str(tmp_path / "ref"), str(folder), "--png", str(png)]) == 2
    err = capsys.readouterr().err
    assert message.format(folder=folder, reference=tmp_path / "ref") in err and "Traceback" not in err
    assert not png.exists()


def test_labels_must_match_the_runs(tmp_path, capsys):
    write_run(tmp_path / "a", LOSSES)
    assert main([str(tmp_path / "a"), "--labels", "x,y"]) == 2
    assert "error: 2 labels for 1 runs (--labels): give one label per run folder" in capsys.readouterr().err


def test_compare_plots_while_the_runs_exist(tmp_path, monkeypatch, capsys):
    """trainkit.tools.compare with its runs faked (no launch): each run writes its metrics into the temporary folder
    that
    compare gives it; the picture must hold them, so it has to be drawn before that folder is removed."""
    offsets = {None: 0.0, "ddp": 1e-7, "fsdp": 3e-7}
    written: dict[str, list[dict]] = {}

    asked = []

    def fake_run(config, output_dir, args, num_processes=None, launch_args=()):
        name = config or "one process"
        written[name] = write_run(output_dir, [x * (1 + offsets[config]) for x in LOSSES[:5]])
        asked.append(args)
        print("[2026-12-01 10:00:00,000] [INFO] Setting accelerator to CPU")  # a library in compare's own process
        return Run(name, 0, "", "", output_dir)

    figures = []

    def plot_and_keep(curves, path, title):
        figures.append(plot(curves, path, title))
        return figures[-1]

    plot = trainkit.tools.compare.plot
    monkeypatch.setattr(trainkit.tools.compare, "run_config", fake_run)
    monkeypatch.setattr(trainkit.tools.compare, "split_for", lambda *args: (2, 8))
    monkeypatch.setattr(trainkit.tools.compare, "plot", plot_and_keep)
    png = tmp_path / "loss_curves.png"
    assert trainkit.tools.compare.main(["--recipe", "mlp", "--configs", "ddp,fsdp", "--max_steps", "5",
                                  "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG" and f"loss curves: {png}" in out
    table = out[out.index("config "):].splitlines()[:3]  # the header and a row per config, in one block
    assert [line.split()[0] for line in table] == ["config", "ddp", "fsdp"], out
    assert all("--eval_every" not in args for args in asked)  # the recipe's evaluations are plotted, not dropped
    [figure] = figures
    loss = figure.axes[0]
    assert [ln.get_label() for ln in loss.lines] == ["one process", "ddp", "fsdp"]
    for line, name in zip(loss.lines, ["one process", "ddp", "fsdp"], strict=True):
        assert_line(line, *column(written[name], "loss"))  # not an empty line: the folders still existed
    for line, config in zip(panel(figure, "|loss - reference|").lines[1:], ["ddp", "fsdp"], strict=True):
        assert line.get_label().startswith(config)
        np.testing.assert_allclose(line.get_ydata(), [offsets[config]] * 5, rtol=1e-6)
