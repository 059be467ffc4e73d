"""A TrainEngine named by import path (``engine.name=plugin_engine:RecordingEngine``).

The FSDP engine, plus one JSON line per ``train_batch`` call and rank recording what the rank was
handed: the trainer's child processes must import it by name, and the rows each rank trains show
whether episodes were split by data-parallel rank.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from areal_cli.engines.archon.engine import ArchonEngine
from areal_cli.engines.fsdp import FSDPEngine


class _Recording:
    """Logs the rows and loss tokens each rank trains on, then trains."""

    def train_batch(self, batch, loss_fn, loss_weight_fn, temperature: float = 1.0):
        rec = {"rank": dist.get_rank(), "dp_rank": self.dp_rank,
               "rows": None if batch is None else int(batch["input_ids"].shape[0]),
               "tokens": None if batch is None else float(batch["loss_mask"].sum())}
        with open(os.environ["AREAL_TEST_RECORD"], "a") as f:
            f.write(json.dumps(rec) + "\n")
        return super().train_batch(batch, loss_fn, loss_weight_fn, temperature=temperature)


class RecordingEngine(_Recording, FSDPEngine):
    """FSDP2 that logs what each rank trains on."""

    dims = "dc"


class RecordingArchon(_Recording, ArchonEngine):
    """Archon that logs what each rank trains on."""

    dims = "dtpc"
