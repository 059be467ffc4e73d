"""``areal check-storage [PATH ...] [--nodes N] [--json]``: probe storage before burning GPU hours."""

from __future__ import annotations

HELP = """Check that PATHs (default: cluster.fileroot) can hold a run: exists, writable, free space
against the checkpoint estimate, fsync latency, sequential write/read throughput, atomic rename, file locking,
filesystem type; with --nodes N > 1 every node writes a token and must read every other node's (under SLURM
through srun, or through --hosts and a command template). s3:// paths: credentials, list, put, get, multipart
upload, delete. A missing directory is reported (exit 1), not created, unless --create. Exit 0 when all
pass, 1 when any fails.

Examples:
  areal check-storage /shared/areal --nodes 2             (inside salloc/sbatch: srun on every node)
  areal check-storage /shared/areal --hosts node1,node2   (ssh {host} {cmd})
  areal check-storage s3://bucket/areal --json
  areal check-storage --override model=qwen2_5_7b --override trainer.keep_checkpoints=3
"""


def refuse_missing(paths: list[str], as_json: bool) -> None:
    """A local path that does not exist: one line, exit 1, nothing created (``--create`` makes it)."""
    import os

    from areal_cli.errors import StorageError

    missing = [p for p in paths if not p.startswith("s3://") and not os.path.lexists(os.path.expanduser(p))]
    if not missing:
        return
    shown = " ".join(missing)
    err = StorageError(f"{shown} does not exist (check-storage creates nothing unless asked) — fix: create it "
                       f"(mkdir -p {shown}), point at an existing directory (cluster.fileroot=DIR), or pass "
                       "--create")
    if as_json:
        from areal_cli.cli.common import error_json, print_json

        print_json(error_json(err))
    raise err


def run(paths: list[str], nodes: int, as_json: bool, hosts: list[str], template: str,
        node_cmds: list[str], overrides: list[str], required_gb: float | None, throughput_mb: int,
        timeout_s: float, srun_args: list[str], create: bool = False) -> int:
    from areal_cli.storage import NodeSpec, estimate_run_bytes, run_storage_check

    required = int(required_gb * 1024**3) if required_gb is not None else 0
    if not paths or required_gb is None:
        from areal_cli.plan.compose import load_config

        cfg = load_config(list(overrides))
        paths = paths or [cfg.cluster.fileroot]
        if required_gb is None:
            required = estimate_run_bytes(cfg)
    if not create and nodes <= 1 and not hosts and not node_cmds:
        refuse_missing(paths, as_json)  # (other nodes may hold a path this one lacks: their probes report it)
    specs = []
    for item in node_cmds:
        name, sep, tmpl = item.partition("=")
        specs.append(NodeSpec(name=name, template=tmpl if sep else "{cmd}"))
    report = run_storage_check(paths, nodes, hosts=hosts or None, template=template, node_specs=specs or None,
                               srun_args=srun_args, required_bytes=required,
                               throughput_bytes=throughput_mb * 1024 * 1024, timeout_s=timeout_s,
                               create=create)
    if as_json:
        from areal_cli.cli.common import print_json

        print_json(report.to_dict())
    else:
        report.render()
    return report.exit_code()


def register(app) -> None:
    import typer

    @app.command("check-storage", help=HELP, no_args_is_help=False)
    def check_storage(
        paths: list[str] = typer.Argument(None, help="Directories or s3:// URLs (default: cluster.fileroot).",
                                          show_default=False),
        nodes: int = typer.Option(1, "--nodes", "-n", help="Nodes that will share the path."),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
        hosts: str = typer.Option("", "--hosts", help="Comma-separated hosts to probe (instead of srun)."),
        template: str = typer.Option("ssh -o BatchMode=yes {host} {cmd}", "--template",
                                     help="How to run the probe on a host: {host}, {cmd} placeholders."),
        node_cmd: list[str] = typer.Option([], "--node", help="NAME=TEMPLATE per node (repeatable); "
                                           "TEMPLATE runs {cmd} somewhere, e.g. in a container."),
        override: list[str] = typer.Option([], "--override", help="Config override used for the default path "
                                           "and the checkpoint-size estimate (repeatable)."),
        required_gb: float = typer.Option(None, "--required-gb", help="Free space needed (default: estimated "
                                          "from the model and trainer.keep_checkpoints)."),
        throughput_mb: int = typer.Option(32, "--throughput-mb", help="Bytes written for the throughput probe."),
        timeout_s: float = typer.Option(30.0, "--timeout", help="Seconds to wait for other nodes' tokens."),
        srun_arg: list[str] = typer.Option([], "--srun-arg", help="Extra srun argument (repeatable)."),
        create: bool = typer.Option(False, "--create", help="Create a missing directory (default: report it "
                                    "missing and exit 1)."),
    ) -> None:
        code = run(list(paths or []), nodes, as_json, [h for h in hosts.split(",") if h], template,
                   list(node_cmd), list(override), required_gb, throughput_mb, timeout_s, list(srun_arg),
                   create)
        raise typer.Exit(code)
