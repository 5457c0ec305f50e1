"""Kill trials and the fault harness that tests, trials and benchmarks share.

- ``harness``  a worker as a real process: start, SIGKILL, SIGSTOP, wait on its log lines
- ``cluster``  a local 3-node JetStream cluster on loopback: leaders, SIGKILL, restart
- ``servers``  the servers a trial kills and restarts (one, or a cluster)
- ``run``      ``jetloop trials``: random kills, every turn judged from state
- ``measures`` detection, false takeovers and the targets, read from the events stream
- ``load``     busy processes beside a trial (``--load N``)
- ``power``    servers on disks that lose what was not synced: power cuts, OS crashes
- ``netns``    a cluster whose nodes each run in a network namespace: partitions, loss, delay
- ``faults``   that cluster's network faults, struck and healed in a trial's rounds

The modes are named here, where the CLI can read them without loading the trials.
"""

MODES = (
    "worker_kill",
    "server_restart",
    "kill_and_restart",
    "takeover",
    "mixed",
    "control",
    "deploy",
    "upgrade",
    "power_loss",
    "cluster_power_loss",
    "cluster_faults",
)
