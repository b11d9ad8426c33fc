from __future__ import annotations

import random

import pytest

from ooc.scheduler import BlockProfile, Profile

MiB = 2**20


def random_profile(n: int, seed: int, *, outside_s: float = 2e-3) -> Profile:
    """A chain with block sizes and times varying like layers of a real network."""
    r = random.Random(seed)
    blocks = []
    for i in range(n):
        saved = r.randint(20, 100) * MiB
        inp = r.randint(2, 10) * MiB
        blocks.append(BlockProfile(f"b{i}", r.uniform(1e-3, 5e-3), r.uniform(2e-3, 10e-3), saved, saved, inp, inp, inp, 0, 0))
    return Profile(tuple(blocks), outside_forward_s=outside_s)


@pytest.fixture()
def make_profile():
    return random_profile
