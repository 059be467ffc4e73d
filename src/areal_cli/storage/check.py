"""``run_storage_check``: what ``areal check-storage`` and every launcher call.

How nodes are reached (first match wins):
1. ``node_specs`` — explicit per-node command templates (see :mod:`crossnode`);
2. ``hosts`` — one node per host through ``template`` (default ``ssh {host} {cmd}``);
3. ``use_srun`` (default: inside a SLURM allocation and ``nodes > 1``) — one srun step;
4. otherwise this node only; with ``nodes > 1`` cross-node visibility is reported as not verified.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from areal_cli.storage.crossnode import DEFAULT_TEMPLATE, NodeSpec, evaluate, run_srun, run_templates
from areal_cli.storage.path_checks import run_local_checks
from areal_cli.storage.report import WARN, CheckResult, StorageReport

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

DEFAULT_THROUGHPUT_BYTES = 32 * 1024 * 1024


def run_storage_check(paths: Sequence[str], nodes: int = 1, *, hosts: Sequence[str] | None = None,
                      template: str = DEFAULT_TEMPLATE, node_specs: Sequence[NodeSpec] | None = None,
                      use_srun: bool | None = None, srun_args: Sequence[str] = (),
                      required_bytes: int = 0, throughput_bytes: int = DEFAULT_THROUGHPUT_BYTES,
                      timeout_s: float = 30.0, s3_options: dict[str, Any] | None = None,
                      python: str | None = None, create: bool = True) -> StorageReport:
    """Check every path; returns the report (``report.ok`` False when any check failed). ``create``: make a
    missing directory (a launch makes its fileroot); ``areal check-storage`` reports it missing instead.

    Also accepts ``run_storage_check(cfg, run_dir)`` (an experiment config first): that is the
    launch-time form, :func:`check_before_launch`, which raises ``StorageError`` on failure.
    """
    if hasattr(paths, "cluster") and hasattr(paths, "trainer"):
        return check_before_launch(paths)
    report = StorageReport()
    s3_paths = [p for p in paths if p.startswith("s3://")]
    local = [os.path.abspath(os.path.expanduser(p)) for p in paths if not p.startswith("s3://")]
    for p in s3_paths:
        from areal_cli.storage.s3 import check_s3

        report.extend(check_s3(p, s3_options))
    if not local:
        return report

    specs = list(node_specs or [])
    if not specs and hosts:
        specs = [NodeSpec.from_host(h, template) for h in hosts]
    n_nodes = len(specs) if specs else int(nodes)
    if use_srun is None:
        use_srun = not specs and n_nodes > 1 and "SLURM_JOB_ID" in os.environ
    multi = n_nodes > 1
    common = dict(timeout_s=timeout_s, required_bytes=int(required_bytes),
                  throughput_bytes=int(throughput_bytes), python=python, create=create)
    if specs:
        run = run_templates(specs, local, **common)
        report.extend(evaluate(run, local, expected_nodes=[s.name for s in specs]))
        return report
    if use_srun:
        run = run_srun(n_nodes, local, srun_args=list(srun_args), **common)
        report.extend(evaluate(run, local))
        return report
    for p in local:
        report.extend(run_local_checks(p, required_bytes=int(required_bytes), multi_node=multi,
                                       throughput_bytes=int(throughput_bytes), create=create))
        if multi:
            report.add(CheckResult(
                "cross-node visibility", WARN, f"not verified for {n_nodes} nodes from this host",
                "run inside a SLURM allocation (salloc/sbatch) or pass --hosts so the probe runs on "
                "every node", path=p))
    return report


def storage_paths_for(cfg: ExperimentConfig) -> list[str]:
    """The paths a run writes to: the fileroot (run dirs, checkpoints, name records)."""
    return [os.path.expanduser(cfg.cluster.fileroot)]


def check_before_launch(cfg: ExperimentConfig, *, srun_args: Sequence[str] = (), use_srun: bool | None = None,
                        node_specs: Sequence[NodeSpec] | None = None,
                        throughput_bytes: int = 8 * 1024 * 1024, console: Any = None) -> StorageReport:
    """The launch-time check; raises :class:`StorageError` listing the failures unless skipped."""
    from areal_cli.errors import StorageError
    from areal_cli.storage.estimate import estimate_run_bytes

    report = run_storage_check(storage_paths_for(cfg), int(cfg.cluster.n_nodes),
                               node_specs=node_specs,
                               use_srun=use_srun, srun_args=srun_args,
                               required_bytes=estimate_run_bytes(cfg), throughput_bytes=throughput_bytes)
    if report.ok:
        return report
    if getattr(cfg, "skip_storage_check", False):
        if console is not None:
            console.print("[yellow]storage check failed; continuing because skip_storage_check=true[/]\n"
                          + report.summary())
        return report
    raise StorageError("the storage check failed, refusing to launch:\n" + report.summary()
                       + "\n(set skip_storage_check=true to launch anyway)")


__all__ = ["run_storage_check", "check_before_launch", "storage_paths_for"]
