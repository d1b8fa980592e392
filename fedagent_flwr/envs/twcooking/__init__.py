"""TextWorld cooking games (beyond FedAgent): a fully offline, reproducible household-style family.

* ``games`` - levels of ``tw-make tw-cooking`` settings; game sets generated once and cached;
* ``engine`` - one game session on TextWorld's Z-machine backend (runs only in the service venv);
* ``env`` - ``TWCookingEnv``, registered as "TWCooking", served per client like ALFWorld.
"""
