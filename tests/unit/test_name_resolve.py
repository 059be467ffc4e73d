"""Name records on the shared fileroot and in a real etcd; records die with their owner."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from areal_cli.utils.name_resolve import (
    EtcdNameRecordRepository,
    FileNameRecordRepository,
    NameEntryExistsError,
    NameEntryNotFoundError,
    make_repository,
)
from areal_cli.utils.network import find_free_port

OWNER = textwrap.dedent("""
    import sys, time
    from areal_cli.utils.name_resolve import FileNameRecordRepository, EtcdNameRecordRepository
    kind, where, name, ttl = sys.argv[1:5]
    repo = FileNameRecordRepository(where) if kind == "file" else EtcdNameRecordRepository(where)
    repo.add(name, "10.0.0.7:4242", keepalive_ttl=float(ttl) or None)
    print("ready", flush=True)
    time.sleep(600)
""")


def _owner(kind: str, where: str, name: str, ttl: float, prefix: list[str] | None = None):
    p = subprocess.Popen([*(prefix or []), sys.executable, "-c", OWNER, kind, where, name, str(ttl)],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _kill(p):
    os.killpg(p.pid, 9)  # SIGKILL: no atexit cleanup runs, as when a node dies
    p.wait(timeout=10)


def _gone_within(repo, name: str, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            repo.get(name)
        except NameEntryNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _exercise_api(repo):
    repo.add("exp/t/servers/0", "h0:1")
    repo.add("exp/t/servers/1", "h1:2")
    repo.add("exp/t/serversX", "other")
    assert repo.get("exp/t/servers/0") == "h0:1"
    assert repo.find_subtree("exp/t/servers") == ["exp/t/servers/0", "exp/t/servers/1"]
    assert repo.get_subtree("exp/t/servers") == ["h0:1", "h1:2"]
    with pytest.raises(NameEntryExistsError):
        repo.add("exp/t/servers/0", "again")
    repo.add("exp/t/servers/0", "h0:9", replace=True)
    assert repo.get("exp/t/servers/0") == "h0:9"
    sub = repo.add_subentry("exp/t/notices", "v3")
    assert sub.startswith("exp/t/notices/") and repo.get_subtree("exp/t/notices") == ["v3"]
    repo.delete("exp/t/servers/1")
    with pytest.raises(NameEntryNotFoundError):
        repo.get("exp/t/servers/1")
    with pytest.raises(TimeoutError):
        repo.wait("exp/t/never", timeout=0.3)
    repo.clear_subtree("exp/t")
    assert repo.find_subtree("exp/t") == []


def test_file_repository_api(tmp_path):
    repo = FileNameRecordRepository(tmp_path / "nr")
    _exercise_api(repo)
    repo.reset()


def test_file_record_dies_with_its_local_owner(tmp_path):
    root = str(tmp_path / "nr")
    reader = FileNameRecordRepository(root)
    p = _owner("file", root, "exp/t/master", 0)
    try:
        assert reader.get("exp/t/master") == "10.0.0.7:4242"
        with pytest.raises(NameEntryExistsError):  # the live owner holds the name
            reader.add("exp/t/master", "mine")
    finally:
        _kill(p)
    # Same host: the pid check makes the record vanish at once, and the name is free again.
    with pytest.raises(NameEntryNotFoundError):
        reader.get("exp/t/master")
    reader.add("exp/t/master", "mine")
    assert reader.get("exp/t/master") == "mine"
    reader.reset()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs unshare -p (root)")
def test_file_record_from_another_node_expires_by_ttl(tmp_path):
    """The owner runs in its own pid namespace: a pid check is meaningless, so only the TTL counts."""
    root = str(tmp_path / "nr")
    reader = FileNameRecordRepository(root)
    p = _owner("file", root, "exp/t/master", 1.0, prefix=["unshare", "-p", "-f"])
    try:
        time.sleep(2.5)  # > TTL: alive only because the owner keeps refreshing it
        assert reader.get("exp/t/master") == "10.0.0.7:4242"
    finally:
        _kill(p)
    assert _gone_within(reader, "exp/t/master", 5.0)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (apt-get install etcd-server)")
    client, peer = find_free_port(), find_free_port()
    data = tmp_path_factory.mktemp("etcd")
    p = subprocess.Popen(["etcd", "--data-dir", str(data), "--listen-client-urls", f"http://127.0.0.1:{client}",
                          "--advertise-client-urls", f"http://127.0.0.1:{client}",
                          "--listen-peer-urls", f"http://127.0.0.1:{peer}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ep = f"127.0.0.1:{client}"
    deadline = time.time() + 30
    while True:
        try:
            EtcdNameRecordRepository(ep).reset()
            break
        except Exception:
            if time.time() > deadline:
                p.kill()
                raise
            time.sleep(0.2)
    yield ep
    p.terminate()
    p.wait(timeout=10)


def test_etcd_repository_api(etcd):
    repo = EtcdNameRecordRepository(etcd, prefix="/areal-test-api/")
    _exercise_api(repo)
    repo.reset()


def test_etcd_record_expires_when_owner_dies(etcd):
    reader = EtcdNameRecordRepository(etcd)
    p = _owner("etcd", etcd, "exp/t/master", 2.0)
    try:
        time.sleep(3.0)  # > TTL: the lease lives because the owner keeps it alive
        assert reader.get("exp/t/master") == "10.0.0.7:4242"
    finally:
        _kill(p)
    assert _gone_within(reader, "exp/t/master", 10.0)


def test_make_repository_from_cluster_config(tmp_path, etcd):
    from areal_cli.config.cluster import ClusterConfig

    f = make_repository(ClusterConfig(fileroot=str(tmp_path)))
    assert isinstance(f, FileNameRecordRepository) and f.root == tmp_path / "name_resolve"
    e = make_repository(ClusterConfig(name_resolve="etcd", etcd_endpoint=etcd))
    assert isinstance(e, EtcdNameRecordRepository)
    from areal_cli.errors import ArealError, ConfigError

    with pytest.raises(ConfigError):
        make_repository(ClusterConfig(name_resolve="zookeeper"))
    with pytest.raises(ArealError, match="cannot reach etcd"):
        EtcdNameRecordRepository(f"127.0.0.1:{find_free_port()}", timeout=1.0)
