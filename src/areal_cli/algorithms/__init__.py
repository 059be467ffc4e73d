"""RL algorithms as pure tensor functions in registries keyed by ``algo`` config values.

- :mod:`.advantages` — GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline), GAE; DAPO overlong penalty
- :mod:`.losses` — PPO clip / dual clip / clip-higher, GSPO, AReaL's decoupled loss, SFT, value loss
- :mod:`.kl` — k1/k2/k3 estimators; :mod:`.normalisation` — masked stats and loss aggregation
- :mod:`.actor` / :mod:`.critic` — glue that drives a ``TrainEngine`` (``PPOActor``, ``PPOCritic``,
  ``SFTLoss``, ``sft_step``)

Nothing is imported here so that importing the package stays free of torch.
"""
