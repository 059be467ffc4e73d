"""Cross-node visibility: run the probe on every node, then check every node read every other's token.

Nodes are reached in one of two ways:

- under SLURM, one ``srun --nodes N --ntasks-per-node 1`` step runs the probe on every node;
- otherwise each :class:`NodeSpec` carries a shell command template with ``{cmd}`` (the probe's
  command line, shell-quoted), ``{host}`` and ``{node_id}`` placeholders, e.g. ``ssh {host} {cmd}``.
  Per-node templates let one "node" run somewhere special (a container, a private mount namespace).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from dataclasses import dataclass, field

from areal_cli.storage.node_probe import MARKER, remove_session
from areal_cli.storage.report import FAIL, PASS, CheckResult

DEFAULT_TEMPLATE = "ssh -o BatchMode=yes {host} {cmd}"


@dataclass
class NodeSpec:
    name: str
    template: str = "{cmd}"  # run locally; DEFAULT_TEMPLATE for ssh hosts
    host: str = ""

    @staticmethod
    def from_host(host: str, template: str = DEFAULT_TEMPLATE) -> "NodeSpec":
        return NodeSpec(name=host, template=template, host=host)


@dataclass
class ProbeRun:
    """What came back from the nodes: parsed results per node, and errors for nodes that failed."""

    results: dict[str, dict] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def probe_argv(paths: list[str], *, expect: int, session: str, timeout_s: float, node_id: str | None,
               required_bytes: int, throughput_bytes: int, python: str | None = None,
               create: bool = True) -> list[str]:
    argv = [python or sys.executable, "-m", "areal_cli.storage.node_probe", "--expect", str(expect),
            "--session", session, "--timeout", str(timeout_s), "--required-bytes", str(required_bytes),
            "--throughput-bytes", str(throughput_bytes)]
    if expect == 1:
        argv.append("--single-node")
    if not create:
        argv.append("--no-create")
    for p in paths:
        argv += ["--path", p]
    if node_id is not None:
        argv += ["--node-id", node_id]
    return argv


def _parse(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        i = line.find(MARKER)
        if i >= 0:
            try:
                out.append(json.loads(line[i + len(MARKER):]))
            except ValueError:
                continue
    return out


def _tail(s: str, n: int = 6) -> str:
    return " | ".join(s.strip().splitlines()[-n:])


def run_templates(nodes: list[NodeSpec], paths: list[str], *, timeout_s: float, required_bytes: int,
                  throughput_bytes: int, python: str | None = None, create: bool = True) -> ProbeRun:
    session = uuid.uuid4().hex[:12]
    procs = []
    for n in nodes:
        argv = probe_argv(paths, expect=len(nodes), session=session, timeout_s=timeout_s, node_id=n.name,
                          required_bytes=required_bytes, throughput_bytes=throughput_bytes, python=python,
                          create=create)
        cmd = n.template.format(cmd=shlex.join(argv), host=n.host or n.name, node_id=n.name)
        procs.append((n, subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, text=True, start_new_session=True)))
    run = ProbeRun()
    for n, p in procs:
        try:
            out, err = p.communicate(timeout=timeout_s * 2 + 120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out, err = p.communicate()
            run.errors[n.name] = "probe timed out"
            continue
        parsed = _parse(out)
        if not parsed:
            run.errors[n.name] = f"probe failed (exit {p.returncode}): {_tail(err or out) or 'no output'}"
        else:
            run.results[n.name] = parsed[0]
    _cleanup(paths, session)
    return run


def _cleanup(paths: list[str], session: str) -> None:
    for p in paths:
        remove_session(p, session)


def run_srun(n_nodes: int, paths: list[str], *, timeout_s: float, required_bytes: int, throughput_bytes: int,
             srun_args: list[str] | tuple[str, ...] = (), python: str | None = None,
             create: bool = True) -> ProbeRun:
    """One srun step, one task per node; node names come from SLURMD_NODENAME."""
    session = uuid.uuid4().hex[:12]
    argv = ["srun", "--nodes", str(n_nodes), "--ntasks-per-node", "1", "--ntasks", str(n_nodes),
            "--kill-on-bad-exit=0", *srun_args,
            *probe_argv(paths, expect=n_nodes, session=session, timeout_s=timeout_s, node_id=None,
                        required_bytes=required_bytes, throughput_bytes=throughput_bytes, python=python,
                        create=create)]
    run = ProbeRun()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s * 2 + 600)
    except FileNotFoundError:
        run.errors["srun"] = "srun not found on PATH"
        return run
    except subprocess.TimeoutExpired:
        run.errors["srun"] = "srun step timed out (waiting for an allocation?)"
        return run
    for rec in _parse(p.stdout):
        run.results[rec["node"]] = rec
    if len(run.results) < n_nodes:
        run.errors["srun"] = (f"only {len(run.results)}/{n_nodes} nodes reported (exit {p.returncode}): "
                              f"{_tail(p.stderr or p.stdout) or 'no output'}")
    _cleanup(paths, session)
    return run


def evaluate(run: ProbeRun, paths: list[str], expected_nodes: list[str] | None = None) -> list[CheckResult]:
    """Per-node local results plus one cross-node row per path naming every blind pair."""
    rows: list[CheckResult] = []
    for node, msg in run.errors.items():
        rows.append(CheckResult("node probe", FAIL, msg, "check that the node is reachable and has this "
                                "Python environment installed", path=",".join(paths), node=node))
    names = sorted(run.results)
    for p in paths:
        for node in names:
            rec = run.results[node]["paths"].get(p, {})
            for r in rec.get("local", []):
                rows.append(CheckResult(**{**r, "node": node}))
            if rec.get("error"):
                rows.append(CheckResult("cross-node visibility", FAIL, rec["error"], path=p, node=node))
        blind = []
        for reader in names:
            seen = run.results[reader]["paths"].get(p, {}).get("seen", {})
            for writer in names:
                tok = run.results[writer]["paths"].get(p, {}).get("token")
                if writer != reader and (tok is None or seen.get(writer) != tok):
                    blind.append((reader, writer))
        missing = [n for n in (expected_nodes or []) if n not in run.results]
        if blind:
            rows.append(CheckResult(
                "cross-node visibility", FAIL, _describe_split(names, blind),
                f"{p} is not one shared filesystem on these nodes: mount the same network filesystem "
                "(nfs, lustre, gpfs, ceph, juicefs, ...) at this path on every node", path=p))
        elif names and not missing and not run.errors:
            rows.append(CheckResult("cross-node visibility", PASS,
                                    f"{len(names)}/{len(names)} nodes read every other node's token", path=p))
        else:
            rows.append(CheckResult("cross-node visibility", FAIL,
                                    f"not verified: nodes {missing or sorted(run.errors)} did not report",
                                    "see the node probe rows", path=p))
    return rows


def _describe_split(names: list[str], blind: list[tuple[str, str]]) -> str:
    """'split: {a} | {b}; b cannot see a, a cannot see b' — groups are mutually visible nodes."""
    blind_set = set(blind)
    groups: list[list[str]] = []
    for n in names:
        for g in groups:
            if all((n, m) not in blind_set and (m, n) not in blind_set for m in g):
                g.append(n)
                break
        else:
            groups.append([n])
    pairs = "; ".join(f"{r} cannot see {w}'s files" for r, w in blind)
    split = " | ".join("{" + ", ".join(g) + "}" for g in groups)
    return f"split: {split}; {pairs}" if len(groups) > 1 else pairs
