"""WebShop text environment, in process: data (§1–2 of shared/specs/webshop.md), search (§5),
reward (§6), pages and actions (§3–4), prompts and projection (§7).

Importing this package registers the environment as "WebShop" (see :mod:`.env`).
"""

from fedagent_flwr.envs.webshop.env import WebShopEnv, shared_world

__all__ = ["WebShopEnv", "shared_world"]
