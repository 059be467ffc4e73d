"""Every name→function registry of the algorithm layer, keyed by the ``algo`` config values."""

from __future__ import annotations

from areal_cli.algorithms.advantages import ADV_ESTIMATORS
from areal_cli.algorithms.kl import KL_ESTIMATORS
from areal_cli.algorithms.losses import POLICY_LOSSES
from areal_cli.algorithms.normalisation import LOSS_AGG

REGISTRIES = {
    "adv_estimator": ADV_ESTIMATORS,
    "policy_loss": POLICY_LOSSES,
    "loss_agg": LOSS_AGG,
    "kl_estimator": KL_ESTIMATORS,
}


def registry_keys() -> dict[str, tuple[str, ...]]:
    """The keys of each registry, for comparison with the config's allowed values."""
    return {name: tuple(reg) for name, reg in REGISTRIES.items()}
