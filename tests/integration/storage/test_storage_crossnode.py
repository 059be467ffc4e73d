"""Cross-node visibility with real processes: two probe "nodes" on this machine.

The split case runs the second node in a private mount namespace (``unshare -m``) with its own
tmpfs mounted over the path, so both nodes see a directory of the same name but different contents.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from areal_cli.storage import NodeSpec, run_storage_check

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare(1) for a private mount namespace")

PRIVATE = 'unshare -m sh -c "mount -t tmpfs areal-private {path} && exec {{cmd}}"'


def _rows(rep, check):
    return [r for r in rep.results if r.check == check]


def test_shared_path_is_visible_from_both_nodes(tmp_path):
    path = str(tmp_path / "shared")
    rep = run_storage_check([path], node_specs=[NodeSpec("node-a"), NodeSpec("node-b")], timeout_s=20,
                            throughput_bytes=256 * 1024)
    vis = _rows(rep, "cross-node visibility")
    assert len(vis) == 1 and vis[0].status == "pass", rep.summary()
    assert "2/2" in vis[0].figure
    # Each node ran the local checks too, labelled with its name.
    assert {r.node for r in _rows(rep, "writable")} == {"node-a", "node-b"}
    # Multi-node on a local filesystem warns (but the visibility proof is what passes).
    assert all(r.status == "warn" for r in _rows(rep, "filesystem"))
    assert rep.ok


def test_private_mount_namespace_split_is_named(tmp_path):
    path = str(tmp_path / "shared")
    os.makedirs(path)
    nodes = [NodeSpec("node-a"), NodeSpec("node-b", template=PRIVATE.format(path=path))]
    rep = run_storage_check([path], node_specs=nodes, timeout_s=3, throughput_bytes=256 * 1024)
    vis = _rows(rep, "cross-node visibility")
    assert len(vis) == 1 and vis[0].status == "fail"
    fig = vis[0].figure
    assert "split: {node-a} | {node-b}" in fig
    assert "node-a cannot see node-b's files" in fig and "node-b cannot see node-a's files" in fig
    assert "same network filesystem" in vis[0].fix
    assert not rep.ok
    # node-b really ran on a different filesystem: its filesystem row says tmpfs.
    fs = {r.node: r.figure for r in _rows(rep, "filesystem")}
    assert fs["node-b"].startswith("tmpfs") and not fs["node-a"].startswith("tmpfs")


def test_three_nodes_one_split_names_only_the_blind_pairs(tmp_path):
    path = str(tmp_path / "shared")
    os.makedirs(path)
    nodes = [NodeSpec("n1"), NodeSpec("n2"), NodeSpec("n3", template=PRIVATE.format(path=path))]
    rep = run_storage_check([path], node_specs=nodes, timeout_s=3, throughput_bytes=0)
    fig = _rows(rep, "cross-node visibility")[0].figure
    assert "split: {n1, n2} | {n3}" in fig
    assert "n1 cannot see n2" not in fig and "n2 cannot see n1" not in fig
    assert "n3 cannot see n1's files" in fig and "n1 cannot see n3's files" in fig


def test_unreachable_node_is_reported(tmp_path):
    path = str(tmp_path / "shared")
    nodes = [NodeSpec("ok"), NodeSpec("dead", template="false {cmd}")]
    rep = run_storage_check([path], node_specs=nodes, timeout_s=2, throughput_bytes=0)
    probe = _rows(rep, "node probe")
    assert probe and probe[0].node == "dead" and probe[0].status == "fail"
    assert not rep.ok


def test_cli_node_templates_exit_1_and_name_the_split(tmp_path):
    path = str(tmp_path / "shared")
    os.makedirs(path)
    r = subprocess.run(
        [sys.executable, "-m", "areal_cli.cli.main", "check-storage", path, "--json", "--required-gb", "0",
         "--throughput-mb", "0", "--timeout", "3", "--node", "a", "--node", "b=" + PRIVATE.format(path=path)],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    vis = [x for x in json.loads(r.stdout)["results"] if x["check"] == "cross-node visibility"]
    assert vis[0]["status"] == "fail" and "split: {a} | {b}" in vis[0]["figure"]


def test_cli_reports_a_missing_path_on_every_node_and_creates_nothing(tmp_path):
    """`areal check-storage` creates nothing unless asked: each node's probe reports the path missing."""
    path = str(tmp_path / "missing")
    r = subprocess.run(
        [sys.executable, "-m", "areal_cli.cli.main", "check-storage", path, "--json", "--required-gb", "0",
         "--throughput-mb", "0", "--timeout", "3", "--node", "a", "--node", "b"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    exists = [x for x in json.loads(r.stdout)["results"] if x["check"] == "exists"]
    assert {(x["node"], x["status"], x["figure"]) for x in exists} == {("a", "fail", "missing"),
                                                                        ("b", "fail", "missing")}
    assert not os.path.exists(path)
