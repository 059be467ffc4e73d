"""``areal eval CKPT|RUN [overrides…]``: held-out evaluation of a checkpoint (checkpoints/evaluate.py)."""

from __future__ import annotations

HELP = """Evaluate a checkpoint on the held-out split with its run's workflow, reward and eval settings.

CKPT|RUN: a run dir, experiment/trial (or experiment: its newest trial) under cluster.fileroot, one of
a run's checkpoints (<run_dir>/checkpoints/step_N, .../final, a recover/step_N state) or any HF model
dir (then the default config). A run means its latest checkpoint (--step N: that one).

Overrides change the run's settings for this evaluation: dataset.test_size=500, dataset=gsm8k,
rollout.eval_gconfig.max_new_tokens=64 (eval_gconfig.X for short), trainer.eval_n_samples=4.

Without --server a built-in hf server is started on the checkpoint and stopped afterwards (--backend
vllm|sglang starts one of those instead); with --server URL requests go to that running server, which
must serve the checkpoint. Prints accuracy, n and mean reward; every sample goes to a JSON file
(<run_dir>/evals/<checkpoint>-<time>.json, or --output).

\b
Examples:
  areal eval cpu_default                               (its latest run)
  areal eval cpu_default/20261129-073015 --step 100 dataset.test_size=500
  areal eval runs/x/y/checkpoints/final --server http://gpu-node:30000 --json
"""


def run(target: str, overrides: list[str], step: int | None, server: str | None, backend: str | None,
        output: str | None, fileroot: str | None, as_json: bool) -> int:
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from areal_cli.checkpoints.evaluate import run_eval
    from areal_cli.errors import UsageError

    from areal_cli.inference.backends import backend_names

    if backend is not None and backend not in backend_names():
        raise UsageError(f"--backend takes {', '.join(backend_names())}, got {backend!r}")
    err = Console(stderr=True)
    bar = Progress(TextColumn("evaluating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err, transient=True, disable=not sys.stderr.isatty())
    task = bar.add_task("eval", total=None)
    with bar:
        res = run_eval(target, overrides, step=step, server=server, backend=backend, output=output,
                       fileroot=fileroot, progress=lambda done, total: bar.update(task, completed=done, total=total))
    if as_json:
        from areal_cli.cli.common import print_json

        print_json(res)
        return 0
    out = Console(highlight=False, soft_wrap=True)
    step_txt = f" (step {res['step']})" if res["step"] is not None else ""
    out.print(f"checkpoint {res['checkpoint']}{step_txt}")
    acc = "n/a (the reward states no correctness)" if res["accuracy"] is None else f"{res['accuracy_pct']:.1f}%"
    out.print(f"held-out accuracy {acc}  n {res['n']}  mean reward {res['reward_mean']:.3f}")
    extra = {k: v for k, v in res["metrics"].items() if k.startswith("eval/pass@") and k != "eval/pass@1"
             or k.startswith("eval/mean@")}
    for k, v in extra.items():
        out.print(f"{k.removeprefix('eval/')} {100 * v:.1f}%")
    out.print(f"samples: {res['samples_file']}")
    return 0


def register(app) -> None:
    import typer

    @app.command("eval", help=HELP)
    def eval_(
        target: str = typer.Argument(..., metavar="CKPT|RUN", help="Run dir, experiment/trial, or checkpoint dir."),
        overrides: list[str] = typer.Argument(None, help="key.path=value or dataset=OPTION.", show_default=False),
        step: int = typer.Option(None, "--step", help="The run's checkpoint at this step (default: latest)."),
        server: str = typer.Option(None, "--server", help="Use this running server (host:port or URL)."),
        backend: str = typer.Option(None, "--backend", help="hf (default), sglang or vllm."),
        output: str = typer.Option(None, "--output", "-o", help="Per-sample JSON file."),
        fileroot: str = typer.Option(None, "--fileroot", help="Where experiment/trial names are looked up."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> int:
        return run(target, list(overrides or []), step, server, backend, output, fileroot, as_json)
