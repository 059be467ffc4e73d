"""``areal sweep``: Hydra's sweep grammar over any config group, run locally or as a SLURM array."""
