"""Hub ids in ``model.path`` (``Qwen/Qwen2.5-0.5B-Instruct``): fetched once per node into the HF cache.

Every consumer (trainer ranks, the hf/vLLM/SGLang servers, tokenizer loading) gets the local snapshot dir,
never the id: they run with ``HF_HUB_OFFLINE=1`` and must not each race to the network.

- :func:`cached_snapshot` reads the cache layout by hand (``models--org--name/refs/<rev>`` →
  ``snapshots/<commit>``): ``validate-config`` uses it without the network and without importing
  huggingface_hub, whose import alone would cost the command a large part of its start-up budget.
- :func:`ensure_hub_model` downloads with ``huggingface_hub.snapshot_download`` under a file lock in the
  cache dir, so of the processes sharing one ``HF_HOME`` one downloads and the others wait, then read the
  snapshot. Only config, tokenizer and ``model*.safetensors`` files are fetched (:data:`ALLOW_PATTERNS`):
  repos often carry the same weights again as ``.bin``/``.pth`` or a ``consolidated.safetensors``, which
  nothing here reads.
- :func:`pin_revision` turns a branch or tag into the commit every node then downloads, so nodes that
  fetch at different times still train the same weights.

Failures become one-line :class:`~areal_cli.errors.ConfigError`\\ s: unknown repo, no access (HF_TOKEN),
unknown revision, and offline or unreachable with nothing cached (with the download command to run).
This module imports no torch; huggingface_hub only inside the functions that talk to the hub.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from areal_cli.errors import ConfigError, StorageError

# What the trainer, the servers and the tokenizer read. The weights pattern is HFCheckpoint's own glob, so a
# repo's duplicate formats (pytorch_model*.bin, original/*.pth, consolidated.safetensors) stay on the hub.
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# huggingface_hub's repo id grammar (validate_repo_id): optional namespace, then a name of [\w.-]
REPO_ID_RE = re.compile(r"^(?:[\w.-]+/)?[\w.-]{1,96}$")
INDEX_FILE = "model.safetensors.index.json"
_TRUE = {"1", "on", "yes", "true"}


def is_hub_id(path: str) -> bool:
    """``org/name`` (or a bare ``name``) that is neither a built-in model nor an existing local path."""
    if not isinstance(path, str) or not path or path.startswith(("builtin:", "/", "./", "../", "~")):
        return False
    if os.path.exists(os.path.expanduser(path)):
        return False
    return bool(REPO_ID_RE.match(path)) and "--" not in path and ".." not in path


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub itself uses (``HF_HUB_CACHE``, else ``HF_HOME/hub``), read from the
    environment now rather than when huggingface_hub was imported."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def _repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def _offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", os.environ.get("TRANSFORMERS_OFFLINE", "")).strip().lower() in _TRUE:
        return True
    consts = sys.modules.get("huggingface_hub.constants")  # fixed when huggingface_hub was imported
    return bool(consts is not None and getattr(consts, "HF_HUB_OFFLINE", False))


def _endpoint(endpoint: str | None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def snapshot_complete(snapshot: str | os.PathLike) -> bool:
    """config.json and every weights file (all shards an index names). A snapshot dir holds a file's link only
    once its blob is whole, so a download that died half-way shows up here as a missing file."""
    d = Path(snapshot)
    if not (d / "config.json").is_file():
        return False
    index = d / INDEX_FILE
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return bool(shards) and all((d / s).is_file() for s in shards)
    return any(p.is_file() for p in d.glob("model*.safetensors"))


def cached_commit(
    repo_id: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> str | None:
    """The commit ``revision`` (default: main) names in the local cache, or None. No network."""
    rev = revision or "main"
    if COMMIT_RE.match(rev):
        return rev
    ref = _repo_folder(Path(cache_dir or hub_cache_dir()), repo_id) / "refs" / rev
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if COMMIT_RE.match(commit) else None


def _snapshot_dir(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None) -> Path | None:
    """The cache's snapshot dir of ``repo_id`` at ``revision`` (whatever it holds so far), or None."""
    cache = Path(cache_dir or hub_cache_dir())
    commit = cached_commit(repo_id, revision, cache)
    return None if commit is None else _repo_folder(cache, repo_id) / "snapshots" / commit


def cached_snapshot(
    repo_id: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> str | None:
    """The complete local snapshot of ``repo_id`` at ``revision``, or None. No network, no huggingface_hub."""
    snap = _snapshot_dir(repo_id, revision, cache_dir)
    return str(snap) if snap is not None and snapshot_complete(snap) else None


def cached_config(
    repo_id: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> str | None:
    """The directory holding ``repo_id``'s cached config.json at ``revision``, or None. Weights need not be
    there: validation reads architecture facts only, so ``hf download org/m config.json`` (kilobytes) is
    enough to plan a run whose nodes download the weights themselves. No network."""
    snap = _snapshot_dir(repo_id, revision, cache_dir)
    return str(snap) if snap is not None and (snap / "config.json").is_file() else None


def hub_cli() -> str:
    """The CLI the installed huggingface_hub ships: ``hf`` since 0.34, ``huggingface-cli`` before."""
    from importlib import metadata

    try:
        names = {ep.name for ep in metadata.distribution("huggingface_hub").entry_points}
    except metadata.PackageNotFoundError:
        names = set()
    return "hf" if "hf" in names or "huggingface-cli" not in names else "huggingface-cli"


def download_command(repo_id: str, revision: str | None = None, *files: str) -> str:
    """The command that fills the cache by hand (with ``files``: only those files of the repo)."""
    return " ".join([hub_cli(), "download", repo_id, *files]) + (f" --revision {revision}" if revision else "")


def _first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if line.strip() and not line.strip().endswith("Client Error."):
            return line.strip()
    return type(exc).__name__


def _not_cached(repo_id: str, revision: str | None, cache: Path, why: str) -> ConfigError:
    at = f" at revision {revision}" if revision else ""
    return ConfigError(
        "model.path",
        f"{repo_id}{at} is not in the Hugging Face cache ({cache}) and {why}",
        f"download it where the hub is reachable, into the same HF_HOME: "
        f"`{download_command(repo_id, revision)}`; or point model.path at a local model dir",
    )


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _kind(exc: BaseException) -> tuple[str, BaseException]:
    """What went wrong: gated, missing, unauthorized, revision, invalid, offline, unreachable, http or disk;
    with the exception that says it (a not-cached error's cause when the hub answered with an HTTP error)."""
    from huggingface_hub import errors as he

    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, he.LocalEntryNotFoundError) and isinstance(cause, he.HfHubHTTPError):
        exc = cause  # snapshot_download wraps the hub's answer when nothing is cached: the answer is the news
    if isinstance(exc, he.GatedRepoError):
        return "gated", exc
    if isinstance(exc, he.RepositoryNotFoundError):
        return ("unauthorized" if _status(exc) in (401, 403) else "missing"), exc
    if isinstance(exc, he.RevisionNotFoundError):
        return "revision", exc
    if isinstance(exc, getattr(he, "HFValidationError", ())):
        return "invalid", exc
    if isinstance(exc, he.HfHubHTTPError):
        return ("unauthorized" if _status(exc) in (401, 403) else "http"), exc
    incomplete = getattr(he, "IncompleteSnapshotError", None)
    if isinstance(exc, he.OfflineModeIsEnabled) or isinstance(cause, he.OfflineModeIsEnabled):
        return "offline", exc
    if isinstance(exc, he.LocalEntryNotFoundError) or (incomplete and isinstance(exc, incomplete)):
        return ("offline" if _offline() else "unreachable"), cause or exc
    if isinstance(exc, OSError) and not _is_network_error(exc):
        return "disk", exc
    return "unreachable", exc


def hub_error(
    exc: BaseException, repo_id: str, revision: str | None, cache: Path, endpoint: str | None = None
) -> Exception:
    """The one-line error for what ``snapshot_download``/``model_info`` raised (huggingface_hub 0.x-2.x)."""
    kind, e = _kind(exc)
    ep = _endpoint(endpoint)
    login = "hf auth login" if hub_cli() == "hf" else "huggingface-cli login"
    token_fix = f"set HF_TOKEN to a token with access to it (or run `{login}`) where areal runs"
    if kind == "gated":
        return ConfigError(
            "model.path",
            f"{repo_id} is gated and this token has no access to it ({_status(e) or 'denied'})",
            f"accept its terms at {ep}/{repo_id}, then {token_fix}",
        )
    if kind == "unauthorized":
        return ConfigError(
            "model.path",
            f"{ep} refused {repo_id} ({_status(e)} Unauthorized): it does not "
            "exist, or it is private or gated",
            f"check the id; if it is private or gated, {token_fix}",
        )
    if kind == "missing":
        return ConfigError(
            "model.path",
            f"there is no model repo {repo_id} on {ep}",
            "check the id (org/name, as on the model's hub page), or point model.path at a local model dir",
        )
    if kind == "revision":
        return ConfigError(
            "model.revision",
            f"{revision!r} is not a branch, tag or commit of {repo_id}",
            "set model.revision to one of its branches, tags or commits, or leave it empty for the "
            "default branch",
        )
    if kind == "invalid":
        return ConfigError(
            "model.path",
            f"{repo_id!r} is not a valid hub id ({_first_line(e)})",
            "write org/name as on the model's hub page, or point model.path at a local model dir",
        )
    if kind == "http":
        return ConfigError(
            "model.path",
            f"{ep} failed while fetching {repo_id} ({_first_line(e)})",
            f"retry later, or run `{download_command(repo_id, revision)}` and rerun",
        )
    if kind == "disk":
        return StorageError(
            f"cannot write {repo_id} into the Hugging Face cache {cache} "
            f"({getattr(e, 'strerror', None) or e}) — fix: set HF_HOME to a writable directory with "
            "room for the model"
        )
    why = (
        "the hub is offline (HF_HUB_OFFLINE=1)"
        if kind == "offline"
        else f"the hub at {ep} is unreachable ({_first_line(e)})"
    )
    return _not_cached(repo_id, revision, cache, why)


def _is_network_error(exc: BaseException) -> bool:
    mod = type(exc).__module__.split(".")[0]
    return mod in ("httpx", "httpx2", "httpcore", "requests", "urllib3") or isinstance(
        exc, (ConnectionError, TimeoutError)
    )


@contextmanager
def node_lock(cache: Path, repo_id: str) -> Iterator[None]:
    """One downloader per repo among the processes sharing ``cache`` (a node, or a cluster when HF_HOME is on
    shared storage that honours flock). The kernel drops the lock of a process that dies, so waiting has no
    timeout: the next waiter then finds the snapshot incomplete and downloads what is missing."""
    from filelock import FileLock, Timeout

    path = cache / ".locks" / "areal" / f"{_repo_folder(cache, repo_id).name}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(
            f"cannot create the Hugging Face cache {cache} ({e.strerror or e}) — fix: set HF_HOME "
            "to a writable directory with room for the model"
        ) from None
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=2)
    except Timeout:
        print(
            f"[areal] waiting for another process on this node to download {repo_id} (lock {path})",
            file=sys.stderr,
            flush=True,
        )
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def ensure_hub_model(
    repo_id: str,
    revision: str | None = None,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """The local snapshot dir of ``repo_id`` at ``revision`` (default branch when empty), downloaded first
    when it is not cached. A cached snapshot is used without asking the hub (a branch stays at the commit that
    was fetched; set ``model.revision`` or re-run the download command to move it)."""
    revision = revision or None
    cache = Path(cache_dir) if cache_dir else hub_cache_dir()
    hit = cached_snapshot(repo_id, revision, cache)
    if hit:
        return hit
    with node_lock(cache, repo_id):
        hit = cached_snapshot(repo_id, revision, cache)  # the process that held the lock fetched it
        if hit:
            return hit
        if _offline():
            raise _not_cached(repo_id, revision, cache, "the hub is offline (HF_HUB_OFFLINE=1)")
        return _download(repo_id, revision, token=token, endpoint=endpoint, cache=cache)


def ensure_hub_config(
    repo_id: str,
    revision: str | None = None,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """The cached directory holding ``repo_id``'s config.json, fetching that one file (not the weights) when
    it is missing: what a submitter needs to plan a run whose nodes download the weights themselves."""
    from huggingface_hub import hf_hub_download

    cache = Path(cache_dir) if cache_dir else hub_cache_dir()
    hit = cached_config(repo_id, revision or None, cache)
    if hit:
        return hit
    if _offline():
        raise _not_cached(repo_id, revision, cache, "the hub is offline (HF_HUB_OFFLINE=1)")
    try:
        path = hf_hub_download(
            repo_id,
            "config.json",
            revision=revision or None,
            cache_dir=str(cache),
            token=token or None,
            endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None,
        )
    except Exception as e:  # noqa: BLE001 - each failure of the hub client becomes one typed line
        raise hub_error(e, repo_id, revision, cache, endpoint) from None
    return str(Path(path).parent)


def _download(
    repo_id: str, revision: str | None, *, token: str | None, endpoint: str | None, cache: Path
) -> str:
    from huggingface_hub import snapshot_download

    print(
        f"[areal] downloading {repo_id}{f' at {revision}' if revision else ''} from {_endpoint(endpoint)} "
        f"into {cache}",
        file=sys.stderr,
        flush=True,
    )
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            allow_patterns=ALLOW_PATTERNS,
            token=token or None,
            endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None,
        )
    except Exception as e:  # noqa: BLE001 - each failure of the hub client becomes one typed line
        raise hub_error(e, repo_id, revision, cache, endpoint) from None
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            "model.path",
            f"{repo_id} has no config.json: it is not a transformers model repo",
            "point model.path at a causal LM repo or a local model dir",
        )
    if not snapshot_complete(path):
        raise ConfigError(
            "model.path",
            f"{repo_id} has no model*.safetensors weights (areal reads safetensors only, not .bin/.pth)",
            "use a revision with safetensors weights, or convert them and point model.path at the local dir",
        )
    return str(path)


def ensure_local_model(path: str, revision: str | None = None, **kw) -> str:
    """``path`` itself for a local dir or a built-in model; the snapshot dir for a hub id."""
    return ensure_hub_model(path, revision, **kw) if is_hub_id(path) else path


def pin_revision(
    repo_id: str, revision: str | None = None, *, endpoint: str | None = None, token: str | None = None
) -> str:
    """The commit ``revision`` names: from the cache when it is there, else asked from the hub once.
    Offline or unreachable: ``revision`` as given (each node then resolves it). A wrong id or revision fails
    here, before anything is submitted."""
    cache = hub_cache_dir()
    rev = revision or None
    if rev and COMMIT_RE.match(rev):
        return rev
    commit = cached_commit(repo_id, rev, cache)
    if commit and cached_snapshot(repo_id, commit, cache):
        return commit
    if _offline():
        return revision or ""
    from huggingface_hub import HfApi

    try:
        info = HfApi(
            endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token or None
        ).model_info(repo_id, revision=rev)
    except Exception as e:  # noqa: BLE001 - mapped below; only an unreachable hub is not an error here
        if _kind(e)[0] != "unreachable":
            raise hub_error(e, repo_id, rev, cache, endpoint) from None
        print(
            f"[areal] {_endpoint(endpoint)} is not reachable from here ({_first_line(_kind(e)[1])}); "
            f"each node resolves {repo_id} {revision or 'main'} itself",
            file=sys.stderr,
            flush=True,
        )
        return revision or ""
    return str(info.sha or revision or "")
