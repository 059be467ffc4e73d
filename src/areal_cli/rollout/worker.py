"""The trainer's rollout side: executor, inference client, workflow and prompt stream, in a process of
their own (``rollout.process=true``, the default) or as a thread of trainer rank 0.

Why a process. The executor's event loop (HTTP, JSON, trajectory assembly, rewards) is Python work.
As a thread of rank 0 it shares the GIL with training: every torch op releases and re-takes the GIL,
and whenever the rollout thread holds it the trainer waits. On the embedded default that was about
20 ms of a 0.15 s async step (trainer wall 0.145 s against 0.125 s of its thread's CPU time; 0.122
against 0.119 in sync mode, where nothing generates during training). A process of its own costs
the trainer only its share of the spare core.

:class:`RolloutService` is the rollout side itself. The trainer talks to one through the same
methods either way: directly (thread mode) or through :class:`RolloutProcess`, which forwards each
call over a pipe to a service in a spawned worker. One call at a time (the trainer's calls are
serial); a reply is ``("ok", value)`` or ``("error", exception)``. Batches cross as numpy arrays
(pickle protocol 5: the buffers are copied once, no tensor serialisation).

The worker exits when the pipe closes (the trainer closed it or died), and PR_SET_PDEATHSIG brings
it down with the trainer even on SIGKILL.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ArealError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


def episode_slices(batch: dict[str, Any], n: int) -> list[tuple[int, int]]:
    """Row ranges of the ``n`` episodes in ``batch`` (concatenated in order). Episodes may have
    different numbers of rows (agent episodes): their rows share one ``group_id`` that no other
    episode uses, so the runs of equal ``group_id`` are the episodes. Without such ids every episode
    has the same number of rows."""
    rows = int(batch["input_ids"].shape[0])
    gid = batch.get("group_id")
    if gid is not None and rows and n:
        g = gid.reshape(-1).tolist()
        starts = [0] + [i for i in range(1, rows) if g[i] != g[i - 1]]
        if len(starts) == n:
            return list(zip(starts, starts[1:] + [rows]))
    if n <= 0 or rows % n:
        raise ValueError(f"cannot split a batch of {rows} rows into {n} episodes: give each episode's rows "
                         "one group_id of their own (rollout/workflows/common.py next_group_id)")
    per = rows // n
    return [(i * per, (i + 1) * per) for i in range(n)]


def canonical_order(batch: dict[str, Any], positions: list[Any]) -> dict[str, Any]:
    """Episodes sorted by prompt position: the executor releases them in completion order, and
    float sums over a batch depend on order — sorting makes a step reproducible."""
    import torch

    n = len(positions)
    if n == 0 or any(p is None for p in positions):
        return batch
    rows = int(batch["input_ids"].shape[0])
    spans = episode_slices(batch, n)
    order = sorted(range(n), key=lambda i: positions[i])
    if order == list(range(n)):
        return batch
    idx = torch.tensor([j for i in order for j in range(*spans[i])])
    perm = idx.tolist()
    # per-row lists (multi_modal: each row's images, api/engine_api.py) move with their rows
    return {k: (v.index_select(0, idx) if hasattr(v, "index_select") and v.dim() >= 1 and v.shape[0] == rows
                else [v[i] for i in perm] if isinstance(v, list) and len(v) == rows
                else v) for k, v in batch.items()}


class RolloutService:
    """Owns the generation client, the workflow (seeded, retried), the executor and the prompt stream."""

    def __init__(self, cfg: ExperimentConfig, addresses: list[str], backend: str, model_path: str,
                 train_items: list[dict], run_dir: str | None = None):
        from areal_cli.rollout.data_stream import PromptStream
        from areal_cli.rollout.episodes import EpisodeRunner
        from areal_cli.rollout import build

        tokenizer = build.build_tokenizer(model_path)
        self.client = build.build_client(cfg, addresses, backend)
        from areal_cli.config.rollout import keep_sampling_mask_active

        gconfig = build.build_gconfig(cfg.rollout.gconfig, tokenizer,
                                      keep_sampling_mask=keep_sampling_mask_active(cfg),
                                      return_routed_experts=bool(cfg.rollout.routing_replay))
        # Kept: a reward with per-step counters (the LLM judge's take_stats) reports them with each batch.
        self.reward = build.build_reward_fn(cfg, addresses)
        self.episodes = EpisodeRunner(build.build_workflow(cfg, tokenizer, gconfig, reward_fn=self.reward,
                                                           run_dir=run_dir),
                                      retry_window_s=float(cfg.launcher.server_startup_timeout_s) + 60,
                                      seed=cfg.seed)
        self.executor = build.build_executor(cfg, self.client, self.episodes, cfg.algo.batch_size)
        self.executor.pad_token_id = int(tokenizer.pad_token_id or 0)
        self.stream = PromptStream(train_items, seed=cfg.seed, shuffle=cfg.dataset.shuffle)

    def next_batch(self, timeout: float) -> dict[str, Any] | None:
        """The next staleness-bounded batch in canonical order, or None after ``timeout`` seconds.
        Its prompt positions are marked consumed."""
        try:
            traj = self.executor.prepare_batch(self.stream, timeout=timeout)
        except TimeoutError:
            return None
        pos = traj.positions
        self.stream.mark_consumed([p for p in pos if p is not None])
        stats = dict(self.executor.last_batch_stats)
        stats["data/positions"] = [int(p) for p in pos if p is not None]
        stats["rollout/episode_retries"] = float(self.episodes.retried)
        take = getattr(self.reward, "take_stats", None)
        if take is not None:
            stats.update(take())
        own = getattr(self.episodes.inner, "rollout_stats", None)  # the online gateway's counters
        if own is not None:
            stats.update(own())
        return {"data": canonical_order(traj.data, pos), "stats": stats}

    def pause(self) -> None:
        self.executor.pause()

    def resume(self) -> None:
        self.executor.resume()

    def set_version(self, version: int) -> None:
        """Every server holds ``version``: tag responses without versions with it, admit at it."""
        self.client.set_version(version)
        self.executor.set_version(version)

    def set_addresses(self, addresses: list[str]) -> None:
        self.client.set_addresses(addresses)
        follow = getattr(self.reward, "set_addresses", None)  # a judge on the rollout servers follows them
        if follow is not None:
            follow(addresses)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "executor": self.executor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.executor.load_state_dict(state["executor"])

    def close(self) -> None:
        """Cancel running episodes and stop the executor (the client's sessions close with its loop),
        then the reward's worker pool, if it has one."""
        self.executor.destroy()
        for part in (self.episodes.inner, self.reward):  # a served proxy or gateway; a reward pool
            close = getattr(part, "close", None)
            if close is not None:
                close()


# ---------------------------------------------------------------------- the process form
class RolloutWorkerDied(ArealError):
    """The rollout worker process exited while the trainer was talking to it."""


def _to_wire(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return ("__t", obj.detach().cpu().numpy())
    if isinstance(obj, dict):
        return {k: _to_wire(v) for k, v in obj.items()}
    return obj


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__t":
        import torch

        return torch.from_numpy(obj[1])
    if isinstance(obj, dict):
        return {k: _from_wire(v) for k, v in obj.items()}
    return obj


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives a pickle round trip (most do), else a RolloutError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - exceptions with custom __init__ signatures do not unpickle
        from areal_cli.rollout.executor import RolloutError

        return RolloutError(f"{type(e).__name__}: {e}")


def _worker_main(conn: Any, parent_pid: int, args: tuple) -> None:
    """Entry point of the spawned worker: build the service, then serve calls until the pipe closes."""
    import traceback

    from areal_cli.utils.procs import die_with_parent, freeze_heap

    arm = die_with_parent(parent=parent_pid)  # die with the trainer, even on its SIGKILL
    if arm is not None:
        arm()
    import torch

    torch.set_num_threads(1)
    try:
        service = RolloutService(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
        traceback.print_exc()
        conn.send_bytes(pickle.dumps(("error", _portable(e)), protocol=5))
        return
    freeze_heap()
    conn.send_bytes(pickle.dumps(("ok", None), protocol=5))
    try:
        while True:
            try:
                name, call_args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            try:
                reply = ("ok", _to_wire(getattr(service, name)(*call_args)))
            except Exception as e:  # noqa: BLE001 - the trainer re-raises it
                reply = ("error", _portable(e))
            conn.send_bytes(pickle.dumps(reply, protocol=5))
            if name == "close":
                return
    finally:
        service.close()


class RolloutProcess:
    """Trainer-side handle of a :class:`RolloutService` running in a spawned worker process."""

    def __init__(self, cfg: ExperimentConfig, addresses: list[str], backend: str, model_path: str,
                 train_items: list[dict], run_dir: str | None = None, *, startup_timeout_s: float = 300.0):
        import multiprocessing as mp
        import multiprocessing.util  # noqa: F401 - Finalize

        ctx = mp.get_context("spawn")  # the trainer has gloo and OpenMP threads: fork is unsafe
        self._conn, child = ctx.Pipe()
        # Not a daemon: the worker may start a reward process pool, and daemons cannot have children.
        self._proc = ctx.Process(target=_worker_main, name="areal-rollout", daemon=False,
                                 args=(child, os.getpid(),
                                       (cfg, addresses, backend, model_path, train_items, run_dir)))
        self._proc.start()
        child.close()
        self._closed = False
        # multiprocessing joins non-daemon children at exit; close the pipe first (the worker exits
        # on EOF) so a trainer that dies on an exception does not hang in that join.
        mp.util.Finalize(self, _shutdown, args=(self._conn, self._proc), exitpriority=10)
        self._reply(startup_timeout_s, "start")

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _reply(self, timeout: float | None, what: str) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RolloutWorkerDied(f"the rollout worker process exited (code {self._proc.exitcode}) "
                                        f"during {what}; its traceback is in this trainer's log")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the rollout worker did not answer {what} within {timeout:.0f}s")
        try:
            status, value = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise RolloutWorkerDied(f"the rollout worker process exited during {what}; "
                                    "its traceback is in this trainer's log") from e
        if status == "error":
            raise value
        return _from_wire(value)

    def _call(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        if self._closed:
            raise RuntimeError(f"rollout worker: {name}() after close()")
        try:
            self._conn.send_bytes(pickle.dumps((name, args), protocol=5))
        except OSError as e:  # a broken pipe: the worker is gone
            self._proc.join(5)
            raise RolloutWorkerDied(f"the rollout worker process exited (code {self._proc.exitcode}) before "
                                    f"{name}(); its traceback is in this trainer's log") from e
        return self._reply(timeout, f"{name}()")

    def next_batch(self, timeout: float) -> dict[str, Any] | None:
        return self._call("next_batch", timeout)

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def set_version(self, version: int) -> None:
        self._call("set_version", int(version))

    def set_addresses(self, addresses: list[str]) -> None:
        self._call("set_addresses", list(addresses))

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def close(self, timeout: float = 15.0) -> None:
        """Stop the worker (cancelling its running episodes) and reap it. Idempotent."""
        if self._closed:
            return
        try:
            if self._proc.is_alive():
                self._call("close", timeout=timeout)
        except (RolloutWorkerDied, TimeoutError, OSError):
            pass
        finally:
            self._closed = True
            _shutdown(self._conn, self._proc, timeout)


def _shutdown(conn: Any, proc: Any, timeout: float = 10.0) -> None:
    conn.close()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def start_rollout(cfg: ExperimentConfig, addresses: list[str], backend: str, model_path: str,
                  train_items: list[dict], run_dir: str | None = None) -> "RolloutService | RolloutProcess":
    """The rollout side for trainer rank 0, in a worker process or in this one (``rollout.process``)."""
    if cfg.rollout.process:
        return RolloutProcess(cfg, addresses, backend, model_path, train_items, run_dir,
                              startup_timeout_s=float(cfg.launcher.server_startup_timeout_s))
    return RolloutService(cfg, addresses, backend, model_path, train_items, run_dir)
