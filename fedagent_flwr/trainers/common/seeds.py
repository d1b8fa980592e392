"""Seeds for the trainers' own randomness (sampling, dropout), derived from the job's seeds.

Labelled parts hashed with sha256, never Python's salted ``hash()``, so a seed is the same in
every process: the same job on the same machine gives bit-identical results.
"""

from __future__ import annotations

import hashlib
import random


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from labelled parts, stable across processes (sha256, not salted hash())."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def reseed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (torch also seeds every CUDA device)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (:func:`reseed`), and ask torch for deterministic kernels."""
    import torch

    reseed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

