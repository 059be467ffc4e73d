"""The input embedding (with a tied head, both) is an FSDP unit of its own (``parallelize.embedding_unit``):
resharded between a micro-batch's forward and its backward, where the root would keep it gathered (issue 35:
1 GiB per rank at Qwen2.5-0.5B's tied 152k x 896), with gradients equal to the one-process model's."""

from __future__ import annotations

import json

import pytest
from fsdp_worker import launch  # noqa: E402
from support_paths import SUPPORT

pytestmark = pytest.mark.engines


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_embedding_is_resharded_between_forward_and_backward(tmp_path, tie):
    out = tmp_path / "out.json"
    launch({"tie": tie, "out": str(out)}, 2, script=str(SUPPORT / "embedding_unit_worker.py"))
    got = json.loads(out.read_text())
    assert got["head_is_embedding"] is (tie == "tied")
    assert got["sharded_between"] == [True, True]
    assert got["grad_diff"] < 1e-5
