"""Which device owns which KV block under context parallelism, and the free
list that keeps the devices' shares balanced.

With context_parallel_size C the KV pool's block axis is split over the
mesh's "context" axis (parallel/sharding.py): device d holds the contiguous
physical blocks [d * B, (d + 1) * B), B = num_blocks / C. Block 0, the null
block, is device 0's, so device 0 has one usable block fewer. A sequence's
block table still lists global block ids in token order; the attention finds
each device's own blocks in it (models/ring_attention.py), so nothing else in
the engine changes.

Allocation: a new block comes from the device with the most free blocks
(ties: the lowest device), so a growing sequence's blocks spread round-robin
over the devices and every device's memory fills at the same pace. That is
what makes the longest servable context C times one device's: a sequence can
use every device's blocks, and its decode work (each device attends to the
blocks it owns) is split evenly too.
"""

from __future__ import annotations

from collections import deque


def block_owner(block_id: int, num_blocks: int, num_devices: int) -> int:
    """The context-axis index of the device holding physical block `block_id`."""
    return block_id // (num_blocks // num_devices)


class OwnedFreeBlocks:
    """The block manager's plain free list, one deque per device: popleft
    takes from the device with the most free blocks, append returns a block
    to its owner's deque. Iteration, len and truth behave like the single
    deque it replaces (tests/block_manager_checks.py reads it as a set)."""

    def __init__(self, num_blocks: int, num_devices: int):
        if num_devices < 1 or num_blocks % num_devices:
            raise ValueError(f"num_blocks ({num_blocks}) must be a multiple of the {num_devices} context devices")
        self.num_blocks = num_blocks
        self.num_devices = num_devices
        per_device = num_blocks // num_devices
        self._lists = [deque(range(max(1, d * per_device), (d + 1) * per_device)) for d in range(num_devices)]

    def popleft(self) -> int:
        fullest = max(range(self.num_devices), key=lambda d: len(self._lists[d]))
        return self._lists[fullest].popleft()

    def append(self, block_id: int) -> None:
        self._lists[block_owner(block_id, self.num_blocks, self.num_devices)].append(block_id)

    def free_per_device(self) -> list[int]:
        return [len(blocks) for blocks in self._lists]

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._lists)

    def __bool__(self) -> bool:
        return any(self._lists)

    def __iter__(self):
        for blocks in self._lists:
            yield from blocks
