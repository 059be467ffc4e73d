"""Reading the commands out of an example's README.md: the ```bash blocks, each logical line (backslash
continuations joined, comments dropped), and the `areal train` / `areal validate-config` invocations as the
overrides and `--config-dir` folders the CLI would receive."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

AREAL_COMMANDS = ("train", "validate-config")
_FLAGS_WITH_VALUE = {"--config-dir", "-cd", "--cfg", "--package", "-p", "-c"}
_BASH = re.compile(r"```bash[ \t]*\n(.*?)```", re.DOTALL)


@dataclass
class ArealCommand:
    command: str                      # "train" or "validate-config"
    overrides: list[str]
    config_dirs: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    text: str = ""

    @property
    def experiment(self) -> str | None:
        found = [o.split("=", 1)[1] for o in self.overrides if o.startswith("experiment=")]
        return found[-1] if found else None


def bash_blocks(readme: Path) -> list[str]:
    return _BASH.findall(readme.read_text())


def logical_lines(block: str) -> list[str]:
    out: list[str] = []
    cur = ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_areal(line: str) -> ArealCommand | None:
    """The first `areal [--config-dir D] train|validate-config ...` of a shell line, or None. Stops at `&&`,
    `;`, `|`; `--config-dir D`, `--config-dir=D` and `-cd D` may stand before or after the subcommand."""
    tokens = shlex.split(line, comments=True)
    if "areal" not in tokens:
        return None
    rest = tokens[tokens.index("areal") + 1:]
    cmd = ArealCommand("", [], text=line)
    j = 0
    while j < len(rest):
        tok = rest[j]
        if tok in ("&&", ";", "||", "|"):
            break
        name, eq, value = tok.partition("=")
        if name in _FLAGS_WITH_VALUE:
            if not eq:
                j += 1
                value = rest[j]
            if name in ("--config-dir", "-cd"):
                cmd.config_dirs.append(value)
        elif tok.startswith("-"):
            cmd.flags.append(tok)
        elif not cmd.command:
            if tok not in AREAL_COMMANDS:
                return None
            cmd.command = tok
        else:
            cmd.overrides.append(tok)
        j += 1
    return cmd if cmd.command else None


def areal_commands(readme: Path) -> list[ArealCommand]:
    """Every `areal train|validate-config` command in the README's bash blocks, in order."""
    out = []
    for block in bash_blocks(readme):
        for line in logical_lines(block):
            cmd = parse_areal(line)
            if cmd is not None:
                out.append(cmd)
    return out


def first_command(readme: Path) -> ArealCommand | None:
    """The first areal command of the README's first bash block that has one."""
    for block in bash_blocks(readme):
        for line in logical_lines(block):
            cmd = parse_areal(line)
            if cmd is not None:
                return cmd
    return None
