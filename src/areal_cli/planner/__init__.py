"""``areal plan``: a cost model of an RL run (memory per component, time per step, throughput, bottleneck),
hardware profiles it is evaluated on, and the search behind ``--suggest``. Torch-free except calibration."""
