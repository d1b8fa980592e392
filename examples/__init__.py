"""Runnable examples of every extension point (docs/extending.md); each is run by tests/test_examples.py.

* ``unscramble_env`` - an in-process environment, selected with ``env=unscramble``;
* ``glossary_env`` - a service-backed environment with a resource shared by its service's pool;
* ``partition_round_robin`` - a task-level partition strategy, selected with ``partition=round_robin``;
* ``median_strategy`` - an aggregation rule (coordinate-wise median) as a FedAvgFSDP subclass;
* ``client_rule`` - a client-side rule (proximal term plus frozen tensors) run by the trainer;
* ``verl_advantage`` - a verl advantage estimator, registered in verl's Ray workers.

``conf/`` holds their Hydra options; ``hydra.searchpath=[pkg://examples.conf]`` adds them to the
project's own ``conf/``.
"""
