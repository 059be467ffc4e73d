"""Reading a run dir from any terminal (``areal runs``, ``areal status``, ``areal logs``): finding runs
under a fileroot, naming one, its state, a status snapshot and its log files. Only the shared filesystem
is read, so a local, SLURM, Ray or SkyPilot run looks the same. No torch."""
