"""Storage checks run by ``areal check-storage`` and before every launch.

Import-light: nothing here imports torch, rich or s3fs at module import.
"""

from __future__ import annotations

from areal_cli.storage.check import check_before_launch, run_storage_check, storage_paths_for
from areal_cli.storage.crossnode import NodeSpec
from areal_cli.storage.estimate import estimate_checkpoint_bytes, estimate_run_bytes, param_count
from areal_cli.storage.report import CheckResult, StorageReport

__all__ = ["run_storage_check", "check_before_launch", "storage_paths_for", "NodeSpec",
           "estimate_checkpoint_bytes", "estimate_run_bytes", "param_count", "CheckResult", "StorageReport"]
