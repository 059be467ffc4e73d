"""One run dir (``<cluster.fileroot>/runs/<experiment_name>/<trial_name>``) read from outside the run.

What a run dir holds and who writes it:

- ``status.json`` (launchers, :class:`~areal_cli.job.status.RunStatusWriter`): ``running`` with a
  heartbeat, then ``done`` / ``failed`` (with the failure's first line) / ``interrupted``;
- ``metrics.jsonl`` (trainer rank 0, :mod:`areal_cli.trainer.stats`): one record per step, evaluation
  and event;
- ``launch.json`` and ``config.yaml`` (``areal train``): the layout (servers, trainer ranks) and the config;
- ``logs/trainer_rank<R>.log``, ``logs/server<I>.log`` (and ``trainer_node<N>.log``, torchrun's own);
- ``servers/<I>.json`` (the address book of live servers), ``node_errors/`` (a node's typed error),
  ``recover/latest.json`` (the step a resume starts from), ``checkpoints/`` (HF exports).

:func:`snapshot` turns these into the object ``areal status --json`` prints (keys: docs/train.md, "Looking at
a run"); :func:`resolve_run` names a run from what a user types.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from areal_cli.errors import ArealError
from areal_cli.job.address_book import read_servers
from areal_cli.job.status import HEARTBEAT_S, NODE_ERRORS, STATUS_FILE, read_status_file
from areal_cli.trainer.stats import METRICS_FILE

RUNS_DIR = "runs"
LAUNCH_FILE = "launch.json"  # trainer/entry.py's name; not imported from there (it is the trainer's module)
CONFIG_FILE = "config.yaml"
MARKERS = (LAUNCH_FILE, CONFIG_FILE, METRICS_FILE, STATUS_FILE)
# A launcher on another machine is presumed gone after this long without a heartbeat (a shared filesystem
# may show another node's write tens of seconds late).
STALE_S = 6 * HEARTBEAT_S
STATES = ("running", "finished", "failed", "interrupted", "queued", "starting")


class RunNotFound(ArealError):
    """The run a command names does not exist, or a rank or server it names has no log."""


# ---------------------------------------------------------------- finding runs


def default_fileroot() -> str:
    """``cluster.fileroot``'s default (the config's, ``~/.cache/areal``)."""
    from areal_cli.config.cluster import ClusterConfig

    return ClusterConfig.fileroot


def runs_root(fileroot: str | None) -> Path:
    return Path(os.path.expanduser(fileroot or default_fileroot())) / RUNS_DIR


def is_run_dir(p: Path) -> bool:
    return p.is_dir() and any((p / m).exists() for m in MARKERS)


def last_active(run_dir: Path) -> float:
    """When the run last wrote anything that says it progressed (its state, a metric, its launch)."""
    best = 0.0
    for name in (STATUS_FILE, METRICS_FILE, LAUNCH_FILE, CONFIG_FILE):
        try:
            best = max(best, (run_dir / name).stat().st_mtime)
        except OSError:
            pass
    return best


def list_runs(fileroot: str | None) -> list[Path]:
    """Every run dir under ``<fileroot>/runs``, most recently active first."""
    root = runs_root(fileroot)
    if not root.is_dir():
        return []
    found = [t for e in root.iterdir() if e.is_dir() for t in e.iterdir() if is_run_dir(t)]
    return sorted(found, key=last_active, reverse=True)


def run_name(run_dir: Path) -> str:
    """``experiment/trial``: the run dir's last two components."""
    return f"{run_dir.parent.name}/{run_dir.name}"


def _latest(dirs: list[Path]) -> Path | None:
    runs = [d for d in dirs if is_run_dir(d)]
    return max(runs, key=last_active) if runs else None


def resolve_run(run: str | None, fileroot: str | None = None) -> Path:
    """The run dir ``run`` names: a run dir path, ``experiment/trial``, ``experiment`` (its most recently
    active trial), or nothing (the most recently active run under the fileroot)."""
    root = runs_root(fileroot)
    if not run:
        runs = list_runs(fileroot)
        if not runs:
            raise RunNotFound(f"no runs under {root} — fix: start one with `areal train`, or pass "
                              "--fileroot DIR (the run's cluster.fileroot)")
        return runs[0]
    p = Path(os.path.expanduser(run))
    if p.is_dir():
        if is_run_dir(p):
            return p.resolve()
        latest = _latest([c for c in p.iterdir() if c.is_dir()])  # an experiment dir
        if latest is None and (p / RUNS_DIR).is_dir():  # a fileroot
            latest = _latest([t for e in (p / RUNS_DIR).iterdir() if e.is_dir() for t in e.iterdir()])
        if latest is not None:
            return latest.resolve()
    if not os.path.isabs(run) and not run.startswith((".", "~")):
        parts = [x for x in run.split("/") if x]
        if len(parts) == 2 and is_run_dir(root / parts[0] / parts[1]):
            return root / parts[0] / parts[1]
        if len(parts) == 1 and (root / parts[0]).is_dir():
            latest = _latest([c for c in (root / parts[0]).iterdir() if c.is_dir()])
            if latest is not None:
                return latest
    known = [run_name(r) for r in list_runs(fileroot)[:5]]
    hint = (f"the most recent under {root}: {', '.join(known)}; `areal runs` lists them all" if known
            else f"there are no runs under {root}; pass --fileroot DIR (the run's cluster.fileroot)")
    raise RunNotFound(f"no run {run!r} (a run dir, EXPERIMENT/TRIAL or EXPERIMENT under {root}) "
                      f"— fix: {hint}")


# ---------------------------------------------------------------- what the run wrote


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved ``config.yaml`` as plain data ({} when missing or unreadable)."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError, ImportError):
        return {}
    except Exception:  # noqa: BLE001 - yaml's own errors: a torn or hand-edited file reads as absent
        return {}
    return cfg if isinstance(cfg, dict) else {}


def read_layout(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / LAUNCH_FILE).read_text()).get("layout", {}) or {}
    except (OSError, ValueError, AttributeError):
        return {}


def _get(d: dict[str, Any], dotted: str, default: Any = None) -> Any:
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


class Metrics:
    """The records of ``metrics.jsonl`` that status needs, read in one pass: every evaluation and event, and
    the last few train and SFT steps (a long run's file holds megabytes of step records; only their tail
    matters here). Records start with their ``kind`` (``StatsLogger.log``), so lines are sorted unparsed."""

    KEEP = 11  # step records kept per kind: the rate over the last ten steps

    def __init__(self, run_dir: Path):
        self.train: list[dict[str, Any]] = []
        self.sft: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        try:
            lines = (run_dir / METRICS_FILE).read_text().splitlines()
        except OSError:
            return
        train, sft = [], []
        for line in lines:
            if line.startswith('{"kind": "train"'):
                train.append(line)
            elif line.startswith('{"kind": "sft"'):
                sft.append(line)
            else:
                rec = _loads(line)
                if rec is None:
                    continue
                kind = rec.get("kind")
                if kind == "eval":
                    self.evals.append(rec)
                elif kind == "event":
                    self.events.append(rec)
                elif kind == "train":
                    train.append(line)
                elif kind == "sft":
                    sft.append(line)
        self.train = [r for r in map(_loads, train[-self.KEEP:]) if r is not None]
        self.sft = [r for r in map(_loads, sft[-self.KEEP:]) if r is not None]

    def ended(self) -> bool:
        """The trainer logged its end after its last start (a resumed run starts again)."""
        for e in reversed(self.events):
            if e.get("event") == "end":
                return True
            if e.get("event") == "start":
                return False
        return False

    def last_start_time(self) -> float:
        starts = [e.get("time", 0.0) for e in self.events if e.get("event") == "start"]
        return float(starts[-1]) if starts else 0.0

    def sec_per_step(self, recs: list[dict[str, Any]]) -> float | None:
        """Seconds per step over the last steps of the current start (a resume's downtime is no step)."""
        since = self.last_start_time()
        pts = [(float(r["time"]), int(r["step"])) for r in recs if r.get("time", 0) >= since and "step" in r]
        if len(pts) < 2 or pts[-1][1] <= pts[0][1]:
            return None
        return (pts[-1][0] - pts[0][0]) / (pts[-1][1] - pts[0][1])


def _loads(line: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None  # a torn last line of a run being written
    return rec if isinstance(rec, dict) else None


# ---------------------------------------------------------------- the run's state


def _pid_alive(pid: int) -> bool:
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess, AccessDenied: not ours to judge, treat as gone
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_state(run_dir: Path, metrics: Metrics | None = None, now: float | None = None) -> tuple[str, str]:
    """``(state, detail)``: running, finished, failed or interrupted (queued: a SLURM job not started yet;
    starting: launched, no status yet). ``running`` is believed only while the launcher is seen alive: its pid
    on its own host, its heartbeat elsewhere."""
    now = time.time() if now is None else now
    st = read_status_file(run_dir)
    state = st.get("state")
    if state == "done":
        return "finished", ""
    if state in ("failed", "interrupted"):
        return state, ""
    if state == "running":
        host, pid = st.get("host"), st.get("pid")
        if pid and host == socket.gethostname():
            if _pid_alive(int(pid)):
                return "running", f"{st.get('launcher', 'launcher')} pid {pid}"
            return "interrupted", f"its launcher (pid {pid}) ended without recording how"
        age = now - float(st.get("heartbeat", st.get("time", 0.0)))
        if age <= STALE_S:
            return "running", f"{st.get('launcher', 'launcher')} on {host}, heartbeat {age:.0f}s ago"
        return "interrupted", f"no heartbeat from {host} for {_dur(age)}"
    metrics = metrics or Metrics(run_dir)
    if metrics.ended():
        return "finished", ""  # a run from before status.json had a running state
    job = run_dir / "slurm_job.json"
    if job.exists():
        try:
            jid = json.loads(job.read_text()).get("job_id", "?")
        except (OSError, ValueError):
            jid = "?"
        return "queued", f"slurm job {jid} submitted, not started"
    if now - last_active(run_dir) <= STALE_S:
        return "starting", ""
    return "interrupted", "no status.json: the launcher never started, or was killed before it wrote one"


def _dur(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def phase(cfg: dict[str, Any], m: Metrics, state: str) -> str:
    """starting, base eval, sft warmup, sft (algo=sft), rl, eval (a periodic or the final evaluation, with the
    export after it) or finished."""
    if state == "finished":
        return "finished"
    total = int(_get(cfg, "trainer.total_steps", 0) or 0)
    every = int(_get(cfg, "trainer.eval_every", 0) or 0)
    steps = m.sft if _get(cfg, "algo.name") == "sft" else m.train
    if steps:
        last = steps[-1]
        step = int(last.get("step", 0))
        evaluated = any(e.get("step") == step and e.get("time", 0) >= last.get("time", 0) for e in m.evals)
        if state == "running" and not evaluated and (step == total or (every and step % every == 0)):
            return "eval"
        return "sft" if steps is m.sft else "rl"
    warm = int(_get(cfg, "trainer.sft_warmup_steps", 0) or 0)
    if _get(cfg, "algo.name") == "sft":
        return "sft" if m.evals else "starting"
    if m.sft:
        return "sft warmup" if int(m.sft[-1].get("step", 0)) < warm else "rl"
    if m.evals:
        return "sft warmup" if warm else "rl"
    if warm and any(e.get("event") == "start" for e in m.events):
        return "base eval"
    return "starting"


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _eval_entry(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    if not rec:
        return None
    return {"step": int(rec.get("step", 0)), "phase": rec.get("phase", "rl"),
            "accuracy": _num(rec.get("eval/pass@1")), "time": _num(rec.get("time"))}


def summary(run_dir: Path, now: float | None = None) -> dict[str, Any]:
    """The run's headline: state, phase, steps, ETA, rates, last evaluation (what ``areal runs`` shows)."""
    now = time.time() if now is None else now
    cfg, m = read_config(run_dir), Metrics(run_dir)
    st = read_status_file(run_dir)
    state, detail = run_state(run_dir, m, now)
    ph = phase(cfg, m, state)
    sft_algo = _get(cfg, "algo.name") == "sft"
    total = int(_get(cfg, "trainer.total_steps", 0) or 0)
    warm = 0 if sft_algo else int(_get(cfg, "trainer.sft_warmup_steps", 0) or 0)
    steps = m.sft if sft_algo else m.train
    step = int(steps[-1]["step"]) if steps else 0
    sft_step = int(m.sft[-1]["step"]) if m.sft and not sft_algo else 0
    rate, sft_rate = m.sec_per_step(steps), (None if sft_algo else m.sec_per_step(m.sft))
    eta = phase_eta = None
    if state == "running":
        if ph == "sft warmup":
            phase_eta = sft_rate * max(0, warm - sft_step) if sft_rate is not None else None
        elif rate is not None:
            eta = phase_eta = rate * max(0, total - step)
    elif state == "finished":
        eta = phase_eta = 0.0
    started = _num(st.get("started"))
    if started is None:
        try:
            started = (run_dir / LAUNCH_FILE).stat().st_mtime
        except OSError:
            started = None
    end = _num(st.get("ended")) if state != "running" else None
    if end is None and state != "running":
        end = last_active(run_dir) or None
    last = m.train[-1] if m.train else {}
    return {
        "run": run_name(run_dir), "run_dir": str(run_dir),
        "experiment": _get(cfg, "experiment_name", run_dir.parent.name),
        "trial": _get(cfg, "trial_name", run_dir.name),
        "launcher": st.get("launcher") or _get(cfg, "launcher.name"),
        "algo": _get(cfg, "algo.name"),
        "state": state, "state_detail": detail, "phase": ph,
        "step": step, "total_steps": total, "sft_step": sft_step, "sft_warmup_steps": warm,
        "started": started, "updated": last_active(run_dir) or None,
        "elapsed_s": ((end if end is not None else now) - started) if started else None,
        "eta_s": eta, "phase_eta_s": phase_eta,
        "reward": _num(last.get("reward/mean")),
        "sft_loss": _num(m.sft[-1].get("sft/loss")) if m.sft else None,
        "samples_per_s": _num(last.get("perf/samples_per_s")),
        "staleness_mean": _num(last.get("staleness/mean")),
        "staleness_max": _num(last.get("staleness/max")),
        "last_eval": _eval_entry(m.evals[-1] if m.evals else None),
        "first_eval": _eval_entry(m.evals[0] if m.evals else None),
        "recover_step": _recover_step(run_dir),
    }


def _recover_step(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "recover" / "latest.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- processes, logs, errors


def logs_dir(run_dir: Path) -> Path:
    return run_dir / "logs"


def rank_log(run_dir: Path, rank: int) -> Path:
    return logs_dir(run_dir) / f"trainer_rank{rank}.log"


def server_log(run_dir: Path, index: int) -> Path:
    return logs_dir(run_dir) / f"server{index}.log"


def _indices(run_dir: Path, prefix: str) -> list[int]:
    out = []
    for p in logs_dir(run_dir).glob(f"{prefix}*.log"):
        tail = p.stem[len(prefix):]
        if tail.isdigit():
            out.append(int(tail))
    return sorted(out)


def trainer_ranks(run_dir: Path) -> list[int]:
    """The run's trainer ranks: the layout's world, and any rank that wrote a log."""
    t = read_layout(run_dir).get("trainer", {}) or {}
    world = 1
    for k in ("dp", "tp", "pp", "cp"):
        world *= int(t.get(k, 1) or 1)
    known = set(range(world)) if t else set()
    return sorted(known | set(_indices(run_dir, "trainer_rank")))


def server_indices(run_dir: Path) -> list[int]:
    specs = read_layout(run_dir).get("servers", []) or []
    return sorted({int(s.get("index", i)) for i, s in enumerate(specs)} | set(_indices(run_dir, "server")))


def log_error(path: Path) -> str | None:
    """The error a process's log ends with, as one line: a typed user error's own line, else the crash line a
    rank printed or an exception's last line (``RuntimeError: ...``); None when the log shows none. The same
    reading as the launchers' failure line (launchers/failures.py)."""
    from areal_cli.launchers.failures import error_line
    from areal_cli.utils.procs import tail_file

    return error_line(tail_file(path, 120))


def _node_error(run_dir: Path) -> str | None:
    from areal_cli.job.status import read_node_error

    if not (run_dir / NODE_ERRORS).is_dir():
        return None
    err = read_node_error(run_dir)
    return str(err) if err is not None else None


def processes(run_dir: Path, state: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(servers, trainer ranks)``, each process with its state, log path and the error its log ends with."""
    published = {int(r["index"]): r for r in read_servers(run_dir) if "index" in r}
    specs = {int(s.get("index", i)): s for i, s in enumerate(read_layout(run_dir).get("servers", []) or [])}
    servers = []
    for idx in server_indices(run_dir):
        rec, spec, log = published.get(idx), specs.get(idx, {}), server_log(run_dir, idx)
        if state == "running":
            s = "up" if rec else "starting"  # starting for the first time, or again after dying
        elif state in ("queued", "starting"):
            s = "pending"
        else:
            s = "stopped"
        err = log_error(log) if state == "failed" or (state == "running" and s == "starting") else None
        servers.append({"index": idx, "name": f"server{idx}", "backend": (rec or spec).get("backend"),
                        "node": spec.get("node"), "state": s, "address": (rec or {}).get("address"),
                        "restarts": int((rec or {}).get("epoch", 0) or 0), "log": str(log), "error": err})
    ranks = []
    for r in trainer_ranks(run_dir):
        log = rank_log(run_dir, r)
        # After an interrupt every rank's log ends in whatever the stop signal cut short: no error to show.
        err = log_error(log) if state == "failed" else None
        if state == "running":
            s = "running" if log.exists() else "starting"
        elif state == "finished":
            s = "done"
        elif state in ("queued", "starting"):
            s = "pending"
        else:
            s = "failed" if err else "stopped"
        ranks.append({"rank": r, "state": s, "log": str(log), "error": err})
    return servers, ranks


def snapshot(run_dir: str | os.PathLike, now: float | None = None) -> dict[str, Any]:
    """Everything ``areal status`` shows, as one JSON-ready dict (stable keys)."""
    run_dir = Path(run_dir)
    out = summary(run_dir, now)
    servers, ranks = processes(run_dir, out["state"])
    out["servers"], out["trainer_ranks"] = servers, ranks
    error = None
    if out["state"] in ("failed", "interrupted"):
        error = (_node_error(run_dir)
                 or next((p["error"] for p in ranks if p["state"] == "failed" and p["error"]), None)
                 or next((p["error"] for p in servers if p["error"]), None))
        if error is None and out["state"] == "failed":
            error = read_status_file(run_dir).get("error")
    out["error"] = error
    return out


def log_for(run_dir: Path, rank: int | None = None, server: int | None = None) -> Path:
    """The log of trainer rank ``rank`` (default 0) or server ``server``; a typed error naming the ones
    there are when it has none."""
    if server is not None:
        which, have, log_of, flag, kind = server, server_indices(run_dir), server_log, "--server", "servers"
        what = f"server {server}"
    else:
        which = 0 if rank is None else rank
        have, log_of, flag, kind = trainer_ranks(run_dir), rank_log, "--rank", "trainer ranks"
        what = f"trainer rank {which}"
    path = log_of(run_dir, which)
    if path.is_file():
        return path
    existing = [i for i in have if log_of(run_dir, i).is_file()]
    if not existing:
        why = f"{what} has no log in {logs_dir(run_dir)} yet"
        fix = "wait for the run to start it (`areal status`), or read the launcher's own output"
    else:
        why = f"{what} has no log in {logs_dir(run_dir)}" if which in have else f"the run has no {what}"
        fix = f"pass {flag} {' or '.join(str(i) for i in existing)}"
    listing = ", ".join(str(i) for i in have) or "none"
    raise RunNotFound(f"{why} ({kind} of {run_name(run_dir)}: {listing}) — fix: {fix}")
