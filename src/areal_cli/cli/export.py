"""``areal export RUN|CKPT --to DIR [--merge-lora]``: an HF dir from a run's checkpoint
(checkpoints/export.py)."""

from __future__ import annotations

HELP = """Write a run's checkpoint as a directory transformers, vLLM and SGLang load (config.json, safetensors
shards with their index, tokenizer files, generation_config.json).

RUN|CKPT: a run dir, experiment/trial (or experiment: its newest trial) under cluster.fileroot, or one of
a run's checkpoints. A run means its latest HF export (--step N: that step's), else its latest recover
state (fsdp and archon runs).

LoRA runs: the adapter in peft's layout plus a README on loading it; --merge-lora: the base model with
the adapter merged in. DIR must be new or empty (--force replaces it).

\b
Examples:
  areal export cpu_default --to ./my_model              (its latest run)
  areal export ~/.cache/areal/runs/lora/t0 --to ./merged --merge-lora
"""


def run(target: str, to: str, step: int | None, merge: bool, force: bool, fileroot: str | None,
        as_json: bool) -> int:
    from rich.console import Console

    from areal_cli.checkpoints.export import export

    err = Console(stderr=True)
    with err.status(f"exporting {target} to {to}", spinner="dots"):
        res = export(target, to, step=step, merge=merge, force=force, fileroot=fileroot)
    if as_json:
        from areal_cli.cli.common import print_json

        print_json(res)
        return 0
    out = Console(highlight=False, soft_wrap=True)
    step_txt = f" (step {res['step']})" if res["step"] is not None else ""
    what = {None: "HF model", "merged": "HF model, LoRA adapter merged", "adapter": "LoRA adapter (peft)"}[res["lora"]]
    out.print(f"exported {res['source']}{step_txt} → {res['to']}: {what} ({', '.join(res['files'])})")
    if res["lora"] == "adapter":
        out.print(f"base model: {res['base']}; how to load it: {res['to']}/README.md")
    return 0


def register(app) -> None:
    import typer

    @app.command("export", help=HELP)
    def export_(
        target: str = typer.Argument(..., metavar="RUN|CKPT", help="Run dir, experiment/trial, or checkpoint dir."),
        to: str = typer.Option(..., "--to", help="The directory to write."),
        step: int = typer.Option(None, "--step", help="The run's checkpoint at this step (default: latest)."),
        merge_lora: bool = typer.Option(False, "--merge-lora", help="LoRA runs: merge the adapter into the base."),
        force: bool = typer.Option(False, "--force", help="Replace a non-empty DIR."),
        fileroot: str = typer.Option(None, "--fileroot", help="Where experiment/trial names are looked up."),
        as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
    ) -> int:
        return run(target, to, step, merge_lora, force, fileroot, as_json)
