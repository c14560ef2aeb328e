"""The training process of one rank, and the reliability hooks that ride along with it.

Nothing here imports ``fleet.controlplane`` or ``fleet.agent``: a worker speaks only the wire
contract (``fleet.proto``) to its node agent, so the same code runs under Ray or a plain
torchrun launch.
"""
