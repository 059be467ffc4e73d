"""ServerFleet and WeightPublisher on a real run dir's address book (job/address_book.py) and a real
inference client: a restarted server (a new epoch) is pending until the trainer has synced it, is then
routed to again, and the next broadcast push names a new weight-update group."""

from __future__ import annotations

from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.job.address_book import publish_server, read_servers, retract_server, wait_for_servers
from areal_cli.weight_sync.fleet import ServerFleet
from areal_cli.weight_sync.publisher import PushTarget, WeightPublisher


def _fleet(run_dir: str) -> ServerFleet:
    return ServerFleet(run_dir, 2, 5.0, read=read_servers, wait=wait_for_servers,
                       connect=lambda addrs, backend, tp=1: RemoteInferenceEngine(addrs, backend, tp_sizes=tp))


def test_a_restarted_server_is_pending_until_synced_then_routed_to_again(tmp_path):
    run_dir = str(tmp_path)
    publish_server(run_dir, 0, "127.0.0.1:1000", 0, None, "hf")
    publish_server(run_dir, 1, "127.0.0.1:1001", 0, None, "hf")
    fleet = _fleet(run_dir)
    fleet.client = fleet.client_for(fleet.wait())
    fleet.adopt(fleet.records())
    told: list[list[str]] = []
    fleet.listeners.append(told.append)
    assert fleet.pending() == [] and fleet.complete()

    retract_server(run_dir, 1)  # the launcher is restarting it
    assert not fleet.complete()
    publish_server(run_dir, 1, "127.0.0.1:2001", 1, None, "hf")
    pending = fleet.pending()
    assert [(r["index"], r["address"], r["epoch"]) for r in pending] == [(1, "127.0.0.1:2001", 1)]

    fleet.rejoin(pending, "version ", 3)
    assert fleet.pending() == [] and fleet.epochs == {0: 0, 1: 1} and fleet.restarts_synced == 1
    assert fleet.client.addresses == told[-1] == ["127.0.0.1:1000", "127.0.0.1:2001"]


def test_the_group_is_renamed_after_a_restart_and_disk_pushes_use_the_run_dir(tmp_path):
    run_dir = str(tmp_path)
    publish_server(run_dir, 0, "127.0.0.1:1000", 0, None, "hf")
    fleet = _fleet(run_dir)
    fleet.n_servers = 1
    fleet.client = fleet.client_for(fleet.wait())
    pub = WeightPublisher(fleet, "distributed", rank=0, target=PushTarget(2, "bfloat16", "gloo"), lora=False,
                          model_path="unused")
    first = pub.meta(1, "distributed")
    assert (first.type, first.world_size, first.dtype, first.backend, first.master_address) == \
        ("distributed", 2, "bfloat16", "gloo", "127.0.0.1")
    assert first.group_name == "areal_weight_update"
    fleet.group_epoch += 1  # what sync_restarted does before bringing a restarted server back
    assert pub.meta(2, "distributed").group_name == "areal_weight_update_r1"
    disk = pub.meta(3, "disk")
    assert (disk.type, disk.version, disk.path) == ("disk", 3, str(tmp_path / "weight_sync"))
