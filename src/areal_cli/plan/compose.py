"""Compose Hydra config groups into a typed :class:`ExperimentConfig`.

Hydra's compose API runs inside typer commands (no ``@hydra.main``). Before Hydra sees the
overrides they are checked here so that typos, unknown groups/options and bad allocation specs
become :class:`ConfigError` with a dotted path and a did-you-mean instead of a Hydra stack trace.
Hydra/OmegaConf are imported lazily: ``areal --help`` never pays for them.
"""

from __future__ import annotations

import json
import os
import re
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal_cli.plan.groups import (
    CONF_DIR,
    GROUPS,
    find_option,
    group_options,
    primary_default,
    search_path,
    user_config_dirs,
)
from areal_cli.config.model import HF_FACTS
from areal_cli.config.paths import describe_type, resolve_path
from areal_cli.config.schema import ExperimentConfig
from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

ALLOC_KEYS = ("allocation_mode", "allocation_mode.spec")


@dataclass
class Prepared:
    """Overrides rewritten for Hydra plus what the user chose explicitly."""

    hydra_overrides: list[str]
    explicit_engine: str | None = None  # the engine the user named, if any
    spec_text: str | None = None  # the raw allocation spec the user gave (preset resolved)
    spec_from: str = ""  # the override that set it, for messages
    explicit_keys: set[str] = field(default_factory=set)
    choices: dict[str, str] = field(default_factory=dict)  # group -> option the user named
    recipe_note: str | None = None  # which experiment was chosen for the user, when they named none


def split_override(text: str) -> tuple[str, str, str | None]:
    """``'+a.b=1'`` → ``('+', 'a.b', '1')``; ``'~a'`` → ``('~', 'a', None)``."""
    prefix = ""
    for p in ("++", "+", "~"):
        if text.startswith(p):
            prefix, text = p, text[len(p):]
            break
    if "=" not in text:
        if prefix == "~":
            return prefix, text, None
        raise ConfigError(text or "<override>", f"override '{text}' has no '='",
                          "write key=value, e.g. rollout.group_size=8 or algo=grpo")
    key, value = text.split("=", 1)
    return prefix, key.strip(), value


def _load_preset_spec(name: str) -> str:
    import yaml

    with open(find_option("allocation_mode", name) or CONF_DIR / "allocation_mode" / f"{name}.yaml") as f:
        data = yaml.safe_load(f) or {}
    return str(data.get("spec", ""))


SWEEP_FUNCTIONS = ("range", "choice", "interval", "tag", "glob")


def sweep_kind(value: str) -> str | None:
    """What makes ``value`` a Hydra sweep (a top-level comma, or a sweep function), or None.

    Hydra itself only says "Ambiguous value for argument" here; a comma inside brackets or quotes
    (``[a,b]``, ``'a,b'``) is a list or a string, not a sweep."""
    v = value.strip()
    m = re.match(r"([a-z]+)\s*\(", v)
    if m and m.group(1) in SWEEP_FUNCTIONS:
        return f"{m.group(1)}()"
    depth, quote = 0, ""
    for ch in v:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            return "comma-separated values"
    return None


def _refuse_sweep(key: str, value: str, overrides: list[str]) -> None:
    import shlex

    kind = sweep_kind(value)
    if kind is not None:
        cmd = " ".join(shlex.quote(o) for o in overrides)
        raise ConfigError(key, f"'{value.strip()}' is a sweep ({kind}): one run takes one value",
                          f"run the sweep with `areal sweep {cmd}`, or pick one value")


def _check_group_value(group: str, value: str, options: dict[str, list[str]]) -> None:
    from areal_cli.errors import did_you_mean

    if value not in options[group]:
        raise ConfigError(group, f"unknown {group} option '{value}'",
                          f"{did_you_mean(value, options[group])}options: {', '.join(options[group])}")


def prepare(overrides: list[str]) -> Prepared:
    """Check overrides against the schema and the conf dir; rewrite allocation specs for Hydra."""
    from areal_cli.allocation.parser import parse_allocation

    options = group_options()
    out: list[str] = []
    prep = Prepared(hydra_overrides=out)
    _load_plugin_overrides(overrides)
    for raw in overrides:
        if not isinstance(raw, str) or not raw.strip():
            raise ConfigError("<override>", "empty override", "remove it or write key=value")
        prefix, key, value = split_override(raw.strip())
        if not key:
            raise ConfigError("<override>", f"override '{raw}' has no key", "write key=value")
        if "@" in key or any(ch.isspace() for ch in key):
            raise ConfigError(key, "package-redirect or spaced override keys are not supported",
                              "write a plain dotted key such as rollout.group_size=8")
        if value is not None:
            _refuse_sweep(key, value, [o.strip() for o in overrides])
        if key in ALLOC_KEYS and prefix != "~" and value is not None:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if key == "allocation_mode" and value in options["allocation_mode"]:
                prep.spec_text = _load_preset_spec(value)
                out.append(f"allocation_mode={value}")
            else:
                parse_allocation(value)  # raises with a caret on the raw text
                prep.spec_text = value
                out.append(f"allocation_mode.spec='{value}'")
            prep.spec_from = f"allocation_mode={value}"
            continue
        if key in GROUPS:
            if prefix == "~" or value is None:
                raise ConfigError(key, f"the '{key}' group cannot be removed", "pick one of its options")
            _check_group_value(key, value.strip(), options)
            if key == "engine":
                prep.explicit_engine = value.strip()
            prep.choices[key] = value.strip()
            out.append(f"{key}={value.strip()}")
            continue
        declared = resolve_path(ExperimentConfig, key)
        if key == "engine.name" and value is not None:
            prep.explicit_engine = value.strip()
        prep.explicit_keys.add(key)
        if not prefix and value is not None and (declared is Any or typing.get_origin(declared) is dict):
            # A mapping's keys are the user's own (env vars, kwargs): adding one must not need Hydra's '+',
            # which the schema's struct mode would otherwise demand with an error about "struct".
            out.append(f"++{raw.strip()}")
            continue
        out.append(raw.strip())
    _resolve_engine(prep)
    _choose_recipe(prep)
    return prep


def _load_plugin_overrides(overrides: list[str]) -> None:
    """Import the modules a ``plugins=[...]`` override names before anything below reads a registry: a plugin
    backend's name must parse in ``allocation_mode`` (validate() loads them again, a no-op by then)."""
    from areal_cli.registry import load_plugins

    for raw in overrides:
        if not isinstance(raw, str):
            continue
        prefix, key, value = split_override(raw.strip())
        if key == "plugins" and not prefix and value is not None:
            items = value.strip().removeprefix("[").removesuffix("]")
            load_plugins([m.strip().strip("'\"") for m in items.split(",") if m.strip()])


def _choose_recipe(prep: Prepared) -> None:
    """``model.path=<hub id>`` of a preset picks that preset (its facts, offline); then, with no experiment
    named, the toy keeps the primary config's cpu_default and a real model gets real_model."""
    from areal_cli.plan.recipe import choose_experiment, preset_for_path, recipe_note

    values = {}
    for ov in prep.hydra_overrides:
        _, key, value = split_override(ov)
        if value is not None and key not in GROUPS:
            values[key] = value
    if "model" not in prep.choices and "model.path" in values:
        preset = preset_for_path(values["model.path"])
        if preset is not None:
            prep.choices["model"] = preset
            prep.hydra_overrides.insert(0, f"model={preset}")
    added = choose_experiment(prep.choices, values, default_model=primary_default("model") or "tiny")
    prep.hydra_overrides.extend(added)
    prep.recipe_note = recipe_note(added, explicit=not added)


def _resolve_engine(prep: Prepared) -> None:
    """Engine/backend rule: the spec's train backend sets ``engine`` unless the user chose one."""
    if prep.spec_text is None:
        return
    from areal_cli.allocation.parser import parse_allocation

    backend = parse_allocation(prep.spec_text).train_backend
    if backend is None:
        return
    if prep.explicit_engine is None:
        prep.hydra_overrides.append(f"engine={backend}")
    elif prep.explicit_engine != backend:
        raise ConfigError(
            "engine", f"engine={prep.explicit_engine} disagrees with {prep.spec_from}, which trains "
            f"with {backend}",
            f"drop engine={prep.explicit_engine} (the spec decides), or drop '{backend}' from the spec "
            f"so the engine supplies it")


def _map_hydra_error(exc: BaseException) -> ConfigError:
    """Turn a Hydra/OmegaConf exception into a ConfigError with the dotted path."""
    from omegaconf.errors import OmegaConfBaseException

    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            path = str(e.full_key)
            try:
                expected = describe_type(resolve_path(ExperimentConfig, path))
            except ConfigError as ce:
                return ce
            value = getattr(e, "value", None)
            msg = str(getattr(e, "msg", "") or e).splitlines()[0]
            if value is not None and "could not be converted" in msg or "Value '" in msg:
                return ConfigError(path, f"expected {expected}, got {value!r}",
                                   f"set {path} to {expected}")
            return ConfigError(path, msg, f"set {path} to {expected}")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError("<overrides>", first, "check the override syntax: key=value, group=option")


def _traced(hydra_overrides: list[str]) -> tuple[ExperimentConfig, dict[str, str]] | None:
    """The composed config and where each value that is not the schema default was set
    (``{"trainer.total_steps": "experiment=real_model"}``), or None when only Hydra composes these overrides."""
    from areal_cli.plan.fastcompose import fast_compose

    trace: dict[str, str] = {}
    cfg = fast_compose(hydra_overrides, search_path(), trace)
    return (cfg, trace) if cfg is not None else None


def _value_at(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def explain_range(exc: ConfigError, prep: Prepared) -> ConfigError:
    """An out-of-range error (config/ranges.py) with the value's origin: the command line (and then what the
    run would use without the override) or the group option or experiment that set it. Any other error,
    or overrides only Hydra composes, come back unchanged."""
    from areal_cli.config.ranges import range_hint

    info = getattr(exc, "out_of_range", None)
    traced = _traced(prep.hydra_overrides) if info is not None else None
    if traced is None or exc.path not in traced[1]:
        return exc
    value, rng = info
    path, origin = exc.path, traced[1][exc.path]
    hint = range_hint(path, rng)
    if origin == "the command line":
        reason = f"{value!r} (set on the command line) is out of range: must be in {rng}"
        base = _traced([o for o in prep.hydra_overrides if split_override(o)[1] != path])
        if base is not None:
            hint += (f"; without the override it is {_value_at(base[0], path)!r} "
                     f"({base[1].get(path, 'the schema default')})")
    else:
        reason = f"{value!r} (set by {origin}) is out of range: must be in {rng}"
        hint += f" (on the command line, or in {origin})"
    err = ConfigError(path, reason, hint)
    err.out_of_range = info
    return err


def compose_dictconfig(overrides: list[str] | None = None, prepared: Prepared | None = None):
    """Compose the packaged conf with ``overrides``; returns an OmegaConf DictConfig."""
    prep = prepared or prepare(list(overrides or []))
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    GlobalHydra.instance().clear()
    extra = user_config_dirs()
    searchpath = [f"hydra.searchpath=[{','.join('file://' + str(d) for d in extra)}]"] if extra else []
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None, job_name="areal"):
            cfg = compose(config_name="config", overrides=searchpath + prep.hydra_overrides)
    except (HydraException, OmegaConfBaseException, ValueError, KeyError, TypeError) as exc:
        raise _map_hydra_error(exc) from None
    _check_engine_after_compose(cfg, prep)
    return cfg


def _check_engine_after_compose(cfg: ExperimentConfig, prep: Prepared) -> None:
    from areal_cli.allocation.parser import parse_allocation

    spec = parse_allocation(str(cfg.allocation_mode.spec))
    backend = spec.train_backend
    if backend is not None and backend != cfg.engine.name:
        src = f"engine={prep.explicit_engine}" if prep.explicit_engine else f"engine={cfg.engine.name}"
        raise ConfigError(
            "engine", f"{src} disagrees with allocation_mode.spec={cfg.allocation_mode.spec} "
            f"(trains with {backend})",
            f"drop one of them: pass engine={backend}, or drop '{backend}' from the spec")


_REGISTERED = False


def register_schemas() -> None:
    """Store the dataclass schemas in Hydra's ConfigStore (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    from areal_cli.config import schema

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=schema.ExperimentConfig)
    _REGISTERED = True


def load_config(overrides: list[str] | None = None, prepared: Prepared | None = None) -> ExperimentConfig:
    """Compose, type-check and return the typed config. Raises ConfigError on any user mistake.

    The common case goes through :mod:`areal_cli.plan.fastcompose` (same result as Hydra,
    without importing it); everything else through Hydra's compose API. ``AREAL_COMPOSE=hydra``
    forces Hydra.
    """
    prep = prepared or prepare(list(overrides or []))
    cfg = None
    if os.environ.get("AREAL_COMPOSE", "fast") != "hydra":
        from areal_cli.plan.fastcompose import fast_compose

        cfg = fast_compose(prep.hydra_overrides, search_path())
        if cfg is not None:
            _check_engine_after_compose(cfg, prep)
    if cfg is None:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        dc = compose_dictconfig(prepared=prep)
        try:
            cfg = OmegaConf.to_object(dc)
        except OmegaConfBaseException as exc:
            raise _map_hydra_error(exc) from None
    assert isinstance(cfg, ExperimentConfig)
    apply_model_dir(cfg, prep.explicit_keys)
    return cfg


def apply_model_dir(cfg: ExperimentConfig, explicit_keys: set[str] | None = None) -> None:
    """If ``model.path`` is a local HF dir, or a hub id whose snapshot is already in the HF cache, take the
    architecture facts from its config.json. The cache is read by hand: no network, no download here.

    Facts the user overrode explicitly (``model.num_hidden_layers=...``) are kept.
    """
    path = cfg.model.path
    revision = cfg.model.revision
    if path.startswith("builtin:"):
        from areal_cli.data.builtin_model import BUILTIN_SPECS

        if path.split(":", 1)[1] not in BUILTIN_SPECS:
            raise ConfigError("model.path", f"unknown built-in model '{path}'",
                              f"use one of: {', '.join('builtin:' + s for s in BUILTIN_SPECS)}, "
                              "or a local HF model directory")
        _no_revision(path, revision)
        _builtin_vision_family(cfg, BUILTIN_SPECS[path.split(":", 1)[1]].family, explicit_keys or set())
        return
    local = os.path.expanduser(path)
    name = os.path.basename(os.path.normpath(local))
    if not os.path.isdir(local):
        if path.startswith(("/", "./", "../", "~")) or os.path.exists(local):
            raise ConfigError("model.path", f"'{path}' is not a model directory",
                              "point model.path at a local HF dir with config.json, or use a model preset")
        from areal_cli.models.hub import cached_config, is_hub_id

        if not is_hub_id(path):
            raise ConfigError("model.path", f"'{path}' is neither a local directory nor a hub id (org/name)",
                              "point model.path at a local HF dir with config.json, or at a hub id such as "
                              "Qwen/Qwen2.5-0.5B-Instruct")
        local = cached_config(path, revision or None) or ""  # weights need not be here yet
        if not local:
            return  # not fetched yet: the preset's facts stand until `areal train` downloads it
        name = path.rsplit("/", 1)[-1]
    else:
        _no_revision(path, revision)
    cfg_file = os.path.join(local, "config.json")
    try:
        with open(cfg_file) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError("model.path", f"'{path}' has no config.json",
                          "point model.path at a HF model directory") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("model.path", f"cannot read {cfg_file}: {exc}",
                          "fix or regenerate the model's config.json") from None
    from areal_cli.config.model import vision_facts

    explicit = explicit_keys or set()
    for fld, v in vision_facts(data).items():
        if f"model.vision.{fld}" not in explicit:
            setattr(cfg.model.vision, fld, v)
    if "vision_config" not in data and "model.vision.depth" not in explicit:
        cfg.model.vision.depth = 0  # a text-only dir under a vision preset: the dir's facts win
    if isinstance(data.get("text_config"), dict):  # multimodal wrappers keep the LM facts here
        data = {**data, **data["text_config"]}
    for fld, keys in HF_FACTS.items():
        if f"model.{fld}" in explicit:
            continue
        for k in keys:
            v = data.get(k)
            if v is None:
                continue
            if fld == "tie_word_embeddings":
                setattr(cfg.model, fld, bool(v))
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                setattr(cfg.model, fld, int(v))
            break
    if "model.name" not in explicit:
        cfg.model.name = name


def _builtin_vision_family(cfg: ExperimentConfig, family: str, explicit: set[str]) -> None:
    """``model.path=builtin:tiny_qwen2_vl`` under another VL preset (``experiment=vision_default`` picks
    ``model=tiny_vl``): the built-in model's tower layout is the path's, as a local dir's config.json would
    say, so the model built (from the ``model`` group's facts) is the one the path names."""
    from areal_cli.config.model import VISION_FAMILIES

    if family in VISION_FAMILIES and cfg.model.vision.depth > 0 and "model.vision.family" not in explicit:
        cfg.model.vision.family = family


def _no_revision(path: str, revision: str) -> None:
    """``model.revision`` picks a commit of a hub repo; with anything else it would be silently ignored."""
    if revision:
        raise ConfigError("model.revision", f"model.revision={revision} only applies to a hub id, but "
                          f"model.path is {path!r}",
                          "drop model.revision, or set model.path to a hub id (org/name)")
