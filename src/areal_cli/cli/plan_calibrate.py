"""``areal plan --calibrate [--name NAME] [--save PATH] [--quick] [--json]``: measure this machine
(planner/calibrate.py), save the profile where ``cluster.hardware=NAME`` finds it, print it."""

from __future__ import annotations

import re

# (field, unit, what it is) in the order the table shows them
_ROWS = (
    ("matmul_tflops", "TFLOP/s", "GEMM rate"),
    ("mem_gb", "GiB", "device memory (RAM on CPU)"),
    ("mem_bw_gbs", "GB/s", "memory bandwidth (copy)"),
    ("intra_node_gbs", "GB/s", "all-reduce bus bandwidth"),
    ("inter_node_gbs", "GB/s", "network per device"),
    ("train_mfu", "", "training / GEMM rate (embedded default's width)"),
    ("prefill_mfu", "", "prefill / GEMM rate"),
    ("decode_bw_eff", "", "decode / memory bandwidth"),
    ("comm_eff", "", "collectives / link bandwidth"),
    ("decode_iter_s", "ms", "decode iteration, fixed part"),
    ("request_s", "ms", "request round trip"),
    ("train_mb_s", "ms", "train micro-batch, fixed part"),
    ("optim_step_s", "ms", "optimizer step (tiny model)"),
    ("process_base_gb", "GiB", "a training rank beyond its model"),
    ("server_base_gb", "GiB", "a server process before its model"),
    ("decode_row_s", "ms", "decode iteration, per running row"),
    ("collective_s", "ms", "small all-reduce round trip"),
    ("tp_layer_s", "ms", "t2 engine: extra per layer and pass"),
    ("tp_token_eff", "", "t2 engine: share of the ideal per-token speed-up"),
)
# Fields a calibration measures (the rest come from the built-in profile it starts from).
_MEASURED_CPU = {"matmul_tflops", "mem_gb", "mem_bw_gbs", "intra_node_gbs", "inter_node_gbs", "train_mfu",
                 "prefill_mfu", "decode_iter_s", "request_s", "train_mb_s", "optim_step_s", "process_base_gb",
                 "server_base_gb", "decode_row_s", "collective_s", "tp_layer_s", "tp_token_eff"}
_MEASURED_GPU = {"matmul_tflops", "mem_gb", "mem_bw_gbs", "decode_iter_s", "request_s", "train_mb_s",
                 "optim_step_s", "process_base_gb", "server_base_gb"}


def default_name() -> str:
    """``cpu`` on a host without CUDA, else the built-in GPU kind this GPU matches (``h100``, ...): the name
    ``cluster.hardware=auto`` resolves to on such a machine, so a plain ``--calibrate`` is what plan uses."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    from areal_cli.planner.calibrate import _gpu_kind

    return _gpu_kind(torch.cuda.get_device_name(0))


def run_calibrate(name: str | None, save: str | None, quick: bool, json_out: bool) -> int:
    """Calibrate, save (``save`` or ``profile_dir()/NAME.json``), print the profile; the exit code."""
    import sys

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from areal_cli.errors import ConfigError, UsageError
    from areal_cli.planner.calibrate import calibrate
    from areal_cli.allocation.hardware import save_profile

    if name is not None and (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name.endswith(".json")):
        raise UsageError(f"--name {name!r}: a profile name is letters, digits, '_', '-' and '.' (it names a file; "
                         "use --save PATH for a path)")
    name = (name or default_name()).lower()
    err = Console(stderr=True)
    bar = Progress(SpinnerColumn(), TextColumn("calibrating: {task.description}"),
                   TextColumn("[dim]{task.completed}/{task.total}"), TimeElapsedColumn(), console=err,
                   transient=True, disable=not sys.stderr.isatty())
    task = bar.add_task("starting", total=None)

    def progress(i: int, n: int, label: str) -> None:
        bar.update(task, description=label, completed=i, total=n)

    with bar:
        profile = calibrate(name, quick=quick, progress=progress)
    try:
        path = save_profile(profile, save)
    except OSError as e:
        raise ConfigError("--save", f"cannot write the profile to {save or 'the profile directory'} ({e})",
                          "give a writable path with --save PATH, or set AREAL_HARDWARE_DIR") from None
    if json_out:
        from areal_cli.cli.common import print_json

        print_json({"profile": profile.to_dict(), "saved": str(path)})
        return 0
    render_profile(profile, Console(highlight=False, soft_wrap=True))
    Console(highlight=False, soft_wrap=True).print(
        f"saved to {path} — use it with cluster.hardware={name if save is None else path}")
    return 0


def render_profile(profile, console) -> None:
    """The profile as a table: value, unit, whether this calibration measured it."""
    from rich.table import Table

    measured = _MEASURED_CPU if profile.kind == "cpu" else _MEASURED_GPU
    if profile.calibrated.get("allreduce_gbs") and profile.kind != "cpu":
        measured = measured | {"intra_node_gbs"}
    table = Table(title=f"hardware profile {profile.name}", title_justify="left")
    for col in ("field", "value", "unit", "", "what"):
        table.add_column(col, justify="right" if col == "value" else "left")
    for field, unit, what in _ROWS:
        v = getattr(profile, field)
        shown = f"{v * 1e3:.3g}" if unit == "ms" else f"{v:.3g}"
        src = "measured" if profile.calibrated and field in measured else ""
        table.add_row(field, shown, unit, src, what)
    console.print(table)
    if profile.train_mfu_points:
        pts = ", ".join(f"h{int(h)}×{int(t)} tok {v:.2f}" for h, t, v in profile.train_mfu_points)
        console.print(f"train_mfu of the engines' RL update (hidden × micro-batch tokens): {pts}")
    console.print(f"source: {profile.source}")
    secs = profile.calibrated.get("seconds")
    if secs is not None:
        console.print(f"calibration took {secs:.0f} s; raw measurements under 'calibrated' in the saved JSON")
