"""ALFWorld (Shridhar et al., 2021) on its real text engine, served per client over HTTP.

* ``service_venv`` - the separate interpreter the service runs under (built on demand, cached);
* ``data`` - the game set in the standard ``json_2.1.1`` layout, FedAgent's seed-42 order, goal metadata;
* ``gameset`` - standard ``game.tw-pddl`` files rebuilt from trials, and goal variants of a scene;
* ``engine`` - one TextWorld/ALFWorld game session (runs only in the service venv);
* ``env`` - ``AlfWorldEnv``, registered as "ALFWorld";
* ``download`` - fetch the official game data (for machines with network).

Only ``engine``/``gameset`` import ``alfworld``/``textworld``; everything else runs in the trainer's venv too.
"""
