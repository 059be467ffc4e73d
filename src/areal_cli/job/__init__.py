"""The run directory every process of a job shares: its layout (launch.json), the server address book and
the run's status. The floor the launchers, the trainer, the servers' supervisors and `areal status` stand on."""
