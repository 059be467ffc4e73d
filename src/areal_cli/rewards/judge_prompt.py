"""The LLM judge's prompt and the reading of its answer, plus the config checks ``validate-config`` runs
for ``workflow.reward=judge``. Import-light (no aiohttp, no torch): the validator reads it.

The prompt is a template with ``{question}``, ``{response}`` and ``{reference}`` (literal braces are
doubled, ``{{``); ``workflow.judge.template`` empty is the built-in one for the parse mode. The answer
is read as (``workflow.judge.parse``):

- ``verdict``: the *last* whole word of ``workflow.judge.verdicts`` in the answer, case-insensitive
  (a judge that reasons first says its verdict last), mapped to its score;
- ``score``: the *first* number, which must lie in [0, 1] (``8/10`` is read as 8, not 10);
- ``score10``: the first number in [0, 10], divided by 10.

``workflow.judge.regex`` overrides where to look: its group 1 (or its whole match when it has no
group) is the verdict word or the number. Anything else is *unparseable* (:class:`Unparseable`).
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_cli.errors import ConfigError

PLACEHOLDERS = ("question", "response", "reference")
PARSE_MODES = ("verdict", "score", "score10")
ON_FAILURE = ("zero", "drop", "retry")
AFTER_RETRIES = ("zero", "drop")
SERVERS = ("rollout", "url")
COMBINE = ("gate", "add")
NO_REFERENCE = "(none given)"

_HEAD = ("You are grading a response to a question.\n\nQuestion:\n{question}\n\nReference answer:\n{reference}\n\n"
         "Response to grade:\n{response}\n\n")
DEFAULT_TEMPLATES = {
    "verdict": _HEAD + "Is the response correct? Reply with one word: correct or incorrect.",
    "score": _HEAD + "How good is the response, from 0 (wrong) to 1 (fully correct)? Reply with the number only.",
    "score10": _HEAD + "How good is the response, from 0 (wrong) to 10 (fully correct)? Reply with the number only.",
}
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


class Unparseable(ValueError):
    """The judge's answer holds no verdict or score this parser accepts."""


def load_template(template: str, parse: str, path: str = "workflow.judge.template") -> str:
    """The template text: the built-in one for ``parse`` when empty, a file's contents when ``template``
    names a file, else ``template`` itself; checked by :func:`check_template`."""
    if not template:
        return DEFAULT_TEMPLATES[parse]
    text = template
    if "{" not in template:
        p = Path(template).expanduser()
        if not p.is_file():
            raise ConfigError(path, f"{template!r} is neither a file nor a template (it has no {{response}})",
                              "give a path to a template file, or text with {question} {response} {reference}")
        text = p.read_text()
    check_template(text, path)
    return text


def check_template(text: str, path: str = "workflow.judge.template") -> None:
    try:
        specs = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(text) if f is not None]
    except ValueError as e:
        raise ConfigError(path, f"the judge template does not parse: {e}",
                          "write placeholders as {question} {response} {reference}; double literal braces: {{ }}")
    fields = [f for f, _, _ in specs]
    bad = [f for f in fields if f not in PLACEHOLDERS]
    if bad:
        raise ConfigError(path, f"the judge template has the unknown placeholder {{{bad[0]}}}",
                          "use only {question} {response} {reference}; double literal braces: {{ }}")
    fancy = [f for f, spec, conv in specs if spec or conv]
    if fancy:
        raise ConfigError(path, f"the judge template formats {{{fancy[0]}}} (a ':' or '!' after the name)",
                          "write the placeholder plainly, e.g. {response}")
    if "response" not in fields:
        raise ConfigError(path, "the judge template has no {response}: the judge would not see what it grades",
                          "put {response} (and {question}, {reference}) in the template")


def render(template: str, question: str, response: str, reference: Any) -> str:
    ref = NO_REFERENCE if reference is None or str(reference).strip() == "" else str(reference)
    return template.format(question=question, response=response, reference=ref)


@dataclass(frozen=True)
class Parser:
    """Reads a score in [0, 1] from a judge's answer (see the module docstring)."""

    mode: str
    verdicts: tuple[tuple[str, float], ...]
    regex: re.Pattern | None

    @classmethod
    def from_config(cls, j: Any) -> Parser:
        return cls(j.parse, tuple((str(k).lower(), float(v)) for k, v in dict(j.verdicts).items()),
                   re.compile(j.regex) if j.regex else None)

    def __call__(self, text: str) -> float:
        if self.regex is not None:
            m = self.regex.search(text)
            if m is None:
                raise Unparseable(f"no match for {self.regex.pattern!r}")
            text = m.group(1) if self.regex.groups else m.group(0)
            if text is None:
                raise Unparseable(f"{self.regex.pattern!r} matched with an empty group 1")
        if self.mode == "verdict":
            return self._verdict(text)
        m = _NUMBER.search(text)
        if m is None:
            raise Unparseable("no number in the answer")
        x = float(m.group(0))
        top = 10.0 if self.mode == "score10" else 1.0
        if not (math.isfinite(x) and 0.0 <= x <= top):
            raise Unparseable(f"{m.group(0)} is outside [0, {top:g}]")
        return x / top

    def _verdict(self, text: str) -> float:
        words = dict(self.verdicts)
        # Longest first, so "incorrect" is never read as "correct".
        alts = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        found = re.findall(rf"(?<!\w)({alts})(?!\w)", text, flags=re.IGNORECASE)
        if not found:
            raise Unparseable(f"none of the verdicts {sorted(words)} in the answer")
        return words[found[-1].lower()]


def check_judge_config(j: Any, *, workflow: str, inference_names: list[str | None]) -> None:
    """``validate-config``'s rules for ``workflow.reward=judge`` (one ConfigError each)."""
    from areal_cli.errors import did_you_mean

    for key, choices in (("server", SERVERS), ("parse", PARSE_MODES), ("on_failure", ON_FAILURE),
                         ("after_retries", AFTER_RETRIES), ("combine", COMBINE)):
        v = getattr(j, key)
        if v not in choices:
            raise ConfigError(f"workflow.judge.{key}", f"unknown value '{v}'",
                              f"{did_you_mean(str(v), choices)}choose one of: {', '.join(choices)}")
    if j.server == "url":
        if not j.base_url or not str(j.base_url).startswith(("http://", "https://")):
            raise ConfigError("workflow.judge.base_url", f"judge.server=url needs the judge's address, got "
                              f"{j.base_url!r}", "set workflow.judge.base_url=http://host:port (an "
                              "OpenAI-compatible server), or workflow.judge.server=rollout")
    if "judge" in inference_names:
        raise ConfigError("allocation_mode.spec", "an inference component named 'judge' would serve rollouts "
                          "and take weight updates: a separately launched judge is not built yet",
                          "start the judge yourself and set workflow.judge.server=url "
                          "workflow.judge.base_url=http://host:port, or judge with the rollout fleet")
    if j.parse == "verdict":
        if not j.verdicts:
            raise ConfigError("workflow.judge.verdicts", "parse=verdict with no verdict words",
                              "set e.g. workflow.judge.verdicts={correct:1.0,incorrect:0.0}")
        for word, score in dict(j.verdicts).items():
            if not isinstance(score, (int, float)) or isinstance(score, bool) or not 0.0 <= score <= 1.0:
                raise ConfigError(f"workflow.judge.verdicts.{word}", f"score {score!r} is not a number in [0, 1]",
                                  "map each verdict word to a score in [0, 1]")
            if not str(word).strip():
                raise ConfigError("workflow.judge.verdicts", "an empty verdict word", "use words like correct")
    if j.regex:
        try:
            rx = re.compile(j.regex)
        except re.error as e:
            raise ConfigError("workflow.judge.regex", f"{j.regex!r} is not a regular expression: {e}",
                              "fix the pattern, or leave it empty for the built-in reading") from None
        if rx.groups > 1:
            raise ConfigError("workflow.judge.regex", f"{j.regex!r} has {rx.groups} groups; group 1 is read",
                              "use (?:...) for the groups other than the one holding the verdict or score")
    load_template(j.template, j.parse)
    if (j.on_failure == "drop" or (j.on_failure == "retry" and j.after_retries == "drop")) and workflow != "rlvr":
        raise ConfigError("workflow.judge.on_failure", f"dropping a sample is supported by workflow rlvr, "
                          f"not {workflow}", "use workflow.judge.on_failure=zero (or retry with after_retries=zero)")
    if j.rule:
        from areal_cli.rewards.registry import REWARDS, is_import_path

        cheap = [n for n in REWARDS.names() if n != "judge" and REWARDS.spec(n).in_process]
        if is_import_path(j.rule) or j.rule not in cheap:
            raise ConfigError("workflow.judge.rule", f"{j.rule!r} is not a cheap in-process rule reward",
                              f"use one of: {', '.join(cheap)} (or leave it empty)")
