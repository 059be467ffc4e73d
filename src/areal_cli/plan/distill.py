"""Rules of ``algo.distill`` (on-policy distillation) that read more than the algo group: the teacher's path,
its engine against the trainer's layout, its tokenizer against the student's, and its size for the memory and
time estimates. Torch-free."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

KEY = "algo.distill"


def distill_on(cfg: ExperimentConfig) -> bool:
    return cfg.algo.distill.enabled and cfg.algo.name != "sft"


def teacher_size_ratio(cfg: ExperimentConfig) -> float:
    """The teacher's parameters over the student's, from the teacher's config.json (1.0 when it cannot be
    read: a hub id not fetched yet is assumed the student's size); 0.0 without a teacher."""
    if not distill_on(cfg):
        return 0.0
    from areal_cli.allocation.estimate import ModelFacts
    from areal_cli.plan.recipe import _local_model_params

    teacher = _local_model_params(cfg.algo.distill.teacher_path)
    student = ModelFacts.from_config(cfg.model).total_params()
    return teacher / student if teacher and student else 1.0


def check_distill(cfg: ExperimentConfig, plan: Any) -> None:
    """One ConfigError per mistake: a ``builtin:`` or missing teacher, an engine that is not a training engine
    or cannot take the trainer's layout, a teacher whose tokenizer differs from the student's (checked here
    when both are already on disk; ``areal train`` checks again once the student is resolved)."""
    if not distill_on(cfg):
        return
    from areal_cli.models.teacher import check_teacher_tokenizer, resolve_teacher_path

    d = cfg.algo.distill
    teacher = resolve_teacher_path(d.teacher_path, fetch=False)
    if d.engine:
        from areal_cli.engines import get_engine_spec

        try:
            spec = get_engine_spec(d.engine)
        except ConfigError as e:
            raise ConfigError(f"{KEY}.engine", e.reason, e.hint) from None
        for t in plan.trains:
            used = {k: v for k, v in (("d", t.parallel.dp), ("t", t.parallel.tp), ("p", t.parallel.pp),
                                      ("c", t.parallel.cp), ("e", t.parallel.ep)) if v > 1}
            missing = [k for k in used if k not in spec.dims]
            if missing:
                raise ConfigError(f"{KEY}.engine", f"the teacher's engine {d.engine} cannot run the trainer's "
                                  f"layout {t.parallel} (it has no {'/'.join(missing)} dimension)",
                                  f"leave {KEY}.engine empty (the student's engine) or pick an engine with "
                                  f"dims {''.join(used)}")
    student = _student_dir(cfg)
    if student and os.path.isdir(teacher):
        check_teacher_tokenizer(student, teacher)


def _student_dir(cfg: ExperimentConfig) -> str | None:
    """The student's model dir when it is already on disk (a local dir, a built built-in model), else None:
    validation builds and downloads nothing."""
    path = cfg.model.path
    if isinstance(path, str) and path.startswith("builtin:"):
        from areal_cli.data.builtin_model import (
            BUILTIN_SPECS,
            builtin_model_dir,
            overrides_from_model_config,
            resolve_spec,
        )

        spec = path.split(":", 1)[1] or "tiny"
        if spec not in BUILTIN_SPECS:
            return None
        out = builtin_model_dir(os.path.expanduser(cfg.cluster.fileroot),
                                resolve_spec(spec, overrides_from_model_config(cfg.model)))
        return str(out) if (out / "config.json").is_file() else None
    p = os.path.expanduser(str(path))
    return p if os.path.isfile(os.path.join(p, "config.json")) else None
