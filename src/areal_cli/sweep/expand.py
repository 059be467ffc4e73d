"""Turn sweep overrides into trials with Hydra's own override parser.

Discrete sweeps (``a=1,2``, ``range(…)``, ``choice(…)``, ``glob(…)``) expand to their cartesian product,
exactly as Hydra's BasicSweeper does. ``interval(…)`` (and ``tag(log, interval(…))``) makes the sweep an
optuna search: hydra-optuna-sweeper's own mapping turns every sweep override into an optuna distribution
and trials are asked from a study one by one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from areal_cli.errors import ConfigError, UsageError


@dataclass
class SweepSpec:
    fixed: list[str] = field(default_factory=list)  # overrides shared by every trial
    swept: list[str] = field(default_factory=list)  # the raw sweep overrides
    swept_keys: list[str] = field(default_factory=list)
    is_search: bool = False  # True when an interval sweep asks for optuna


def group_options(group: str) -> list[str]:
    """Options of a config group over the config search path (no Hydra init needed)."""
    from areal_cli.plan.groups import group_options as all_options

    return all_options().get(group, [])


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed = []
    for raw in overrides:
        try:
            parsed.extend(parser.parse_overrides([raw]))
        except OverrideParseException as e:
            key = raw.split("=", 1)[0]
            raise ConfigError(key or raw, f"cannot parse sweep override {raw!r}: {str(e).splitlines()[0]}",
                              "use Hydra's syntax, e.g. algo.optim.lr=1e-6,3e-6 or seed=range(1,4)") from None
    return parsed


def split_overrides(overrides: list[str]) -> SweepSpec:
    spec = SweepSpec()
    for raw, ov in zip(overrides, _parse(overrides)):
        if ov.is_sweep_override():
            spec.swept.append(raw)
            spec.swept_keys.append(ov.key_or_group)
            if ov.is_interval_sweep():
                spec.is_search = True
        else:
            spec.fixed.append(raw)
    return spec


def _glob_filter(ov) -> list[str]:
    """Resolve ``glob(…)`` against the group's options (Hydra resolves it against the config repo)."""
    opts = group_options(ov.key_or_group)
    if not opts:
        raise ConfigError(ov.key_or_group, "glob() sweeps need a config group, and this key is not one",
                          f"list values explicitly, e.g. {ov.key_or_group}=a,b")
    return ov.value().filter(opts)


def format_value(value) -> str:
    """A value as override text that Hydra parses back to the same value.

    Hydra's own sweep formatting backslash-escapes ``:`` and friends, which reads badly in trial
    names and tables; quoting anything that is not a plain word keeps it exact and readable.
    """
    import re

    from hydra.core.override_parser.types import Override

    if isinstance(value, str):
        if re.fullmatch(r"[A-Za-z0-9_./-]+", value):
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return Override._get_value_element_as_str(value)


def expand_grid(swept: list[str]) -> list[list[str]]:
    """Cartesian product of discrete sweeps (first key slowest, as in Hydra's BasicSweeper)."""
    import itertools

    axes = []
    for ov in _parse(swept):
        if ov.is_interval_sweep():
            raise UsageError("interval() sweeps are searched by optuna, which needs a trial count — "
                             "fix: pass --n-trials N")
        key = ov.get_key_element()
        if ov.value_type is not None and ov.value_type.name == "GLOB_CHOICE_SWEEP":
            values = _glob_filter(ov)
        else:
            values = list(ov.sweep_iterator())
        axes.append([f"{key}={format_value(v)}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def optuna_distributions(swept: list[str]) -> dict:
    """Optuna distributions for every sweep override, via hydra-optuna-sweeper's own mapping."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override

    out = {}
    for ov in _parse(swept):
        if ov.value_type is not None and ov.value_type.name == "GLOB_CHOICE_SWEEP":
            raise ConfigError(ov.key_or_group, "glob() cannot be combined with an optuna search",
                              "list the choices explicitly: choice(a,b)")
        out[ov.key_or_group] = create_optuna_distribution_from_override(ov)
    return out


def trial_id(overrides: list[str]) -> str:
    """A stable, readable id: index-free so a resumed sweep maps trials back to their dirs."""
    digest = hashlib.sha1("\0".join(sorted(overrides)).encode()).hexdigest()[:8]
    return f"t-{digest}"
