"""The verl trainer backend: one verl GRPO/PPO job per (round, client), run as a subprocess.

``entry`` (the ``python -m`` target), ``overrides`` (TrainJob -> Hydra overrides), ``dataset``
(env-instance rows, verl's ``data.custom_cls``), ``agent_loop`` (the episode runner as a verl
agent loop), ``fedprox`` (the proximal hook inside verl's workers), ``settings`` (typed knobs),
``verl_log`` (metric lines). Only ``agent_loop`` imports verl at module level; nothing here is
imported by the ClientApp itself, so nodes without verl run the reference backend unaffected.
"""
