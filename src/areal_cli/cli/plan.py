"""``areal plan [overrides…] [--suggest] [--json] [--hardware NAME]``: the cost model of the composed config.

Options are parsed in one place (:func:`register` builds :class:`PlanOptions`; :func:`run` acts on it), so a
new option is one field, one ``typer.Option`` and one branch in :func:`run`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import typer  # at module level: typer resolves the `typer.Context` annotation from module globals

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

HELP = ("Predict the composed config's run before spending GPU hours: memory per component and what binds "
        "first, the time of one RL step (generation, rewards, training, weight sync; sync and async), "
        "samples/s, tokens/s, utilisation per pool and the bottleneck. --suggest searches the split of the "
        "cluster between inference and training that maximises samples/s. Exit 0, 1 invalid config or "
        "unknown hardware, 2 usage error.")


@dataclass
class PlanOptions:
    suggest: bool = False
    as_json: bool = False
    hardware: str | None = None  # a profile name or a saved profile's .json path; None: from the config
    calibrate: bool = False  # measure this machine, save the profile, plan nothing
    name: str | None = None  # --calibrate: the saved profile's name (default: cpu, or the GPU's kind)
    save: str | None = None  # --calibrate: a path to save to instead of the profile directory
    quick: bool = False  # --calibrate: fewer repetitions
    caps: bool = False  # lengths from the caps, not from a sample of the dataset


def profile_for(cfg: ExperimentConfig, name: str | None = None):
    """The hardware profile ``plan`` uses: ``--hardware``, else ``cluster.hardware`` where the config has it,
    else ``auto``: ``cpu`` on a CPU cluster and ``h100`` on GPUs."""
    from areal_cli.allocation.hardware import AUTO_PROFILE, get_profile, resolve_hardware

    if name is None:
        return resolve_hardware(cfg)
    if str(name).lower() == "auto":
        name = AUTO_PROFILE.get(str(cfg.cluster.device), "h100")
    return get_profile(name, "--hardware")


def run(overrides: list[str], opts: PlanOptions) -> int:
    from areal_cli.cli.common import compose_and_validate, error_json, print_json
    from areal_cli.errors import ArealError
    from areal_cli.planner.model import plan_config

    if opts.calibrate:
        if overrides:
            from areal_cli.errors import UsageError

            raise UsageError("--calibrate measures this machine and takes no overrides — fix: run "
                             "`areal plan --calibrate` alone, then `areal plan OVERRIDES --hardware NAME`")
        from areal_cli.cli.plan_calibrate import run_calibrate

        return run_calibrate(opts.name, opts.save, opts.quick, opts.as_json)
    cfg, plan = compose_and_validate(overrides, opts.as_json)
    try:
        profile = profile_for(cfg, opts.hardware)
    except ArealError as exc:
        if opts.as_json:
            print_json(error_json(exc))
        raise
    lengths = None
    if not opts.caps:
        from areal_cli.planner.lengths import dataset_prompt_lengths

        lengths = dataset_prompt_lengths(cfg)
    kw = {} if lengths is None else {"prompt_tokens": lengths.mean, "max_prompt_tokens": lengths.max}
    rp = plan_config(cfg, plan, profile, **kw)
    sug = None
    if opts.suggest:
        from areal_cli.planner.suggest import suggest

        sug = suggest(cfg, plan, profile, **kw)
    if opts.as_json:
        out = {"valid": True, **rp.to_dict(), "validation": {"warnings": plan.warnings, "notes": plan.notes},
               "lengths": None if lengths is None else asdict(lengths)}
        if sug is not None:
            out["suggest"] = sug.to_dict()
        print_json(out)
        return 0
    from areal_cli.cli.plan_render import render_run_plan, render_suggestion

    render_run_plan(rp, plan, lengths=None if lengths is None else lengths.describe())
    if sug is not None:
        render_suggestion(sug)
    return 0


def register(app) -> None:
    from areal_cli.cli.common import OVERRIDES_HELP
    from areal_cli.cli.main import groups_epilog
    from areal_cli.cli.options import help_option

    @app.command("plan", help=f"{HELP}\n\nOVERRIDES: {OVERRIDES_HELP}.", epilog=groups_epilog(),
                 options_metavar="[OPTIONS] [OVERRIDES]...", add_help_option=False,
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
    def plan(
        ctx: typer.Context,
        suggest: bool = typer.Option(False, "--suggest", help="Search the inference/training split (and "
                                     "d/t/p within each) that maximises samples/s within memory."),
        as_json: bool = typer.Option(False, "--json", help="Print everything (or the error) as JSON."),
        hardware: str = typer.Option(None, "--hardware", help="Hardware profile: h100, h200, a100, b200, "
                                     "l40s, cpu, a calibrated profile's name or a .json path (default: "
                                     "cluster.hardware, else cpu on CPU clusters and h100 on GPUs).",
                                     show_default=False),
        calibrate: bool = typer.Option(False, "--calibrate", help="Measure this machine (matmul rate, memory "
                                       "bandwidth, the built-in server's decode rate, all-reduce bandwidth, "
                                       "training overheads) and save it as a hardware profile."),
        name: str = typer.Option(None, "--name", help="--calibrate: the profile's name (default: cpu, or "
                                 "the GPU's kind).", show_default=False),
        save: str = typer.Option(None, "--save", help="--calibrate: save to this .json path instead of "
                                 "the profile directory.", show_default=False),
        quick: bool = typer.Option(False, "--quick", help="--calibrate: fewer repetitions (less exact)."),
        caps: bool = typer.Option(False, "--caps", help="Plan every prompt at half of dataset.max_prompt_len "
                                  "(the longest at the cap) instead of reading a sample of the dataset."),
        help_: bool = help_option(),
    ) -> int:
        return run(list(ctx.args), PlanOptions(suggest=suggest, as_json=as_json, hardware=hardware,
                                               calibrate=calibrate, name=name, save=save, quick=quick,
                                               caps=caps))
