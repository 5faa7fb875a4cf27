"""A repeatable uniform draw keyed by a request's uid, without seeding a whole Mersenne Twister.

``random.Random(uid)`` expands the uid into 624 words of generator state (~5 us) to answer one
``randrange(n)`` with n <= placement.CHOICE_CANDIDATES. A keyed hash gives what the choice needs
from it: the same uid always draws the same index (idempotent retries, deterministic tests),
different uids draw independently, and each index of ``range(n)`` is equally likely. BLAKE2b's
64-bit digest reduced modulo n favours some indexes by at most n / 2**64, far below anything a
cluster could observe.
"""

from __future__ import annotations

import hashlib


class Draw:
    """The one ``randrange`` that placement.choose asks of its random source, keyed by ``seed``."""

    __slots__ = ("_value",)

    def __init__(self, seed: str) -> None:
        self._value = int.from_bytes(hashlib.blake2b(seed.encode("utf-8", "surrogatepass"),
                                                     digest_size=8).digest(), "big")

    def randrange(self, stop: int) -> int:
        if stop <= 0:
            raise ValueError(f"empty range for randrange({stop})")
        return self._value % stop
