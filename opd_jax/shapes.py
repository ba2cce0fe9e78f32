"""Shape buckets: round a length up so a handful of shapes cover all lengths (one XLA
compilation per bucket instead of one per length)."""
from __future__ import annotations


def bucket(n: int, multiple: int) -> int:
    """The smallest power of two >= n up to `multiple`; past it, the next multiple of it.

    bucket(5, 64) = 8, bucket(64, 64) = 64, bucket(65, 64) = 128, bucket(130, 64) = 192.
    With a power-of-two `multiple` every bucket is a multiple of the previous ones'
    granularity, so buckets never shrink as n grows."""
    if n <= multiple:
        return 1 << max(0, (max(n, 1) - 1).bit_length())
    return -(-n // multiple) * multiple
