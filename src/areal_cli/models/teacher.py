"""The teacher of on-policy distillation (``algo.distill``): where its weights are, and whether it reads the
student's tokens.

The teacher scores the student's sampled token ids as they are, so both must map every id to the same
string: a teacher of another size is fine, a teacher with another tokenizer is refused (in one line) before
any process starts. Torch-free: the CLI calls this before launching.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from areal_cli.errors import ConfigError

KEY = "algo.distill.teacher_path"


def resolve_teacher_path(path: str, *, fetch: bool = True, key: str = KEY, role: str = "teacher") -> str:
    """A local HF dir (absolute) or a hub id (its snapshot, downloaded first; ``fetch=False``: the id).
    ``key``/``role``: the config path and the word the errors use (a reward model resolves the same way)."""
    from areal_cli.models.hub import ensure_hub_model, is_hub_id

    if isinstance(path, str) and path.startswith("builtin:"):
        raise ConfigError(key, f"{path} is a freshly initialised model, not a {role}",
                          "train one first (areal train ...) and point this at its HF export "
                          "(<run dir>/checkpoints/final)")
    p = Path(os.path.expanduser(path))
    if (p / "config.json").is_file():
        return str(p.resolve())
    if is_hub_id(path):
        return ensure_hub_model(path, None) if fetch else path
    raise ConfigError(key, f"{path} is not a local HF model dir (no config.json) nor a hub id",
                      "point it at a directory written by save_pretrained / areal export, or a hub id")


def _vocab(tok: Any) -> dict[str, int]:
    return dict(tok.get_vocab())


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why ``teacher`` cannot score ``student``'s token ids (None: it can): a different vocabulary (a token
    missing or under another id) or a different end-of-sequence token."""
    sv, tv = _vocab(student), _vocab(teacher)
    if sv != tv:
        if len(sv) != len(tv):
            return f"its tokenizer has {len(tv)} tokens, the student's {len(sv)}"
        diff = sorted(k for k in sv.keys() | tv.keys() if sv.get(k) != tv.get(k))
        return (f"its tokenizer maps {len(diff)} of {len(sv)} tokens differently (first: {diff[0]!r} is id "
                f"{tv.get(diff[0])} there, {sv.get(diff[0])} in the student's)")
    if student.eos_token_id != teacher.eos_token_id:
        return f"its end-of-sequence id is {teacher.eos_token_id}, the student's {student.eos_token_id}"
    return None


def check_teacher_tokenizer(student_dir: str, teacher_dir: str, teacher_key: str = KEY, *, role: str = "teacher",
                            fix: str = "distil from a teacher that shares the student's tokenizer (same family; "
                                       "any size)") -> None:
    """One-line :class:`ConfigError` unless the teacher's (``role``'s) tokenizer equals the student's."""
    from transformers import AutoTokenizer

    try:
        teacher = AutoTokenizer.from_pretrained(teacher_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(teacher_key, f"cannot load a tokenizer from {teacher_dir}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
                          f"the {role}'s dir must hold its tokenizer files (save_pretrained writes them)") from None
    why = tokenizer_mismatch(AutoTokenizer.from_pretrained(student_dir), teacher)
    if why is not None:
        raise ConfigError(teacher_key, f"the {role} at {teacher_dir} cannot score the student's tokens: {why}", fix)
