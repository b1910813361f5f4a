"""lambda-Scale's binomial pipeline (§4): how one source node hands a model's weights, split
into ``b`` blocks, to ``N`` receivers when every node may send at most one block to one node
and receive at most one block from one node per step, and forwards blocks it already holds
while it is still receiving others. Node 0 is the source, receivers are 1..N.

The source sends block ``i`` in step ``i`` (counting from 0); every node forwards blocks it
holds, so each block's holders double each step and the blocks follow one another down the
pipeline. ``binomial_pipeline`` takes exactly

    steps_needed(N, b) = b − 1 + ⌈log2(N + 1)⌉   steps (N = 1: b steps),

which is optimal: the last block cannot leave the source before the ``b``-th step, and then
its holders at most double per step, from 2 to all ``N + 1`` nodes. With ``N + 1 = 2^k`` nodes
it is the classic ``b + k − 1``. The issue's ``b + ⌈log2 N⌉ − 1`` is that count with ``N``
counting the source too; with ``N`` receivers it is one step short exactly when ``N`` is a
power of two (``N = 1`` would give ``b − 1`` steps for ``b`` blocks the source must send).

With ``N + 1 = 2^k``, node ``r`` sends to ``r + 2^i`` (mod ``N + 1``), the binomial tree's
edges, using ``i = 0, 1, …, k − 1`` in turn; for other ``N`` the distances are ``N + 1`` halved
repeatedly, rounding up. Which block each node receives in each step is Träff's round-optimal
schedule for this circulant graph ("Round-optimal n-block broadcast schedules in logarithmic
time", 2023). ``fan_out`` is the naive baseline: the source sends every block to every
receiver itself, ``N × b`` steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """In ``step``, ``sender`` sends ``block`` to ``receiver`` (node 0 is the source)."""

    step: int
    sender: int
    receiver: int
    block: int


def steps_needed(receivers: int, blocks: int) -> int:
    """Steps ``binomial_pipeline`` takes: ``blocks − 1 + ⌈log2(receivers + 1)⌉``."""
    _check_arguments(receivers, blocks)
    return blocks - 1 + receivers.bit_length()  # N.bit_length() == ⌈log2(N + 1)⌉


def binomial_pipeline(receivers: int, blocks: int) -> list[list[Transfer]]:
    """The pipelined broadcast: one list of transfers per step, ``steps_needed`` steps."""
    _check_arguments(receivers, blocks)
    nodes = receivers + 1
    skips = _skips(nodes)
    rounds = len(skips) - 1  # one phase: each distance used once
    plan = {r: _receive_schedule(r, skips) for r in range(1, nodes)}
    # Skip the first rounds of phase 0 so that the last phase ends with the last block.
    lead = -(blocks - 1) % rounds
    held = [set(range(blocks))] + [set[int]() for _ in range(receivers)]
    schedule: list[list[Transfer]] = []
    for step in range(steps_needed(receivers, blocks)):
        phase, k = divmod(step + lead, rounds)
        transfers = []
        for r in range(1, nodes):
            # Blocks before 0 do not exist yet; past the end, the slot carries the last block.
            block = min(plan[r][k] + phase * rounds - lead, blocks - 1)
            if block >= 0 and block not in held[r]:
                transfers.append(Transfer(step, (r - skips[k]) % nodes, r, block))
        for t in transfers:
            held[t.receiver].add(t.block)
        schedule.append(transfers)
    return schedule


def fan_out(receivers: int, blocks: int) -> list[list[Transfer]]:
    """The source alone sends receiver 1 every block, then receiver 2, …: ``N × b`` steps."""
    _check_arguments(receivers, blocks)
    return [
        [Transfer(step, 0, step // blocks + 1, step % blocks)] for step in range(receivers * blocks)
    ]


def check_schedule(schedule: Sequence[Sequence[Transfer]], receivers: int, blocks: int) -> None:
    """Raise ``ValueError`` unless ``schedule`` obeys the model and delivers every block."""
    _check_arguments(receivers, blocks)
    held = [set(range(blocks))] + [set[int]() for _ in range(receivers)]
    for step, transfers in enumerate(schedule):
        senders: set[int] = set()
        takers: set[int] = set()
        for t in transfers:
            if t.step != step:
                raise ValueError(f"{t} is listed in step {step}")
            if not (0 <= t.sender <= receivers and 1 <= t.receiver <= receivers):
                raise ValueError(f"{t}: no such sender or receiver among {receivers} receivers")
            if t.sender == t.receiver:
                raise ValueError(f"{t}: node {t.sender} sends to itself")
            if not 0 <= t.block < blocks:
                raise ValueError(f"{t}: no such block among {blocks}")
            if t.sender in senders:
                raise ValueError(f"step {step}: node {t.sender} sends more than one block")
            if t.receiver in takers:
                raise ValueError(f"step {step}: node {t.receiver} receives more than one block")
            if t.block not in held[t.sender]:
                raise ValueError(f"{t}: node {t.sender} does not hold block {t.block} yet")
            senders.add(t.sender)
            takers.add(t.receiver)
        # Only what a node held when the step began can be forwarded in it.
        for t in transfers:
            held[t.receiver].add(t.block)
    for node in range(1, receivers + 1):
        missing = sorted(set(range(blocks)) - held[node])
        if missing:
            raise ValueError(f"receiver {node} never gets blocks {missing}")


def _check_arguments(receivers: int, blocks: int) -> None:
    if receivers < 1 or blocks < 1:
        raise ValueError(f"need at least one receiver and one block: {receivers=}, {blocks=}")


def _skips(nodes: int) -> list[int]:
    """The doubling distances ``s_0 = 1 < … < s_q = nodes``, ``s_i = ⌈s_(i+1) / 2⌉``."""
    skips = [nodes]
    while skips[0] > 1:
        skips.insert(0, (skips[0] + 1) // 2)
    return skips


def _base_block(r: int, skips: list[int]) -> int:
    """The round of a phase in which a single block from node 0 first reaches ``r`` (0: ``q``)."""
    reached = 0
    for i in reversed(range(len(skips) - 1)):
        if reached + skips[i] == r:
            return i
        if reached + skips[i] < r:
            reached += skips[i]
    return len(skips) - 1


def _receive_schedule(r: int, skips: list[int]) -> list[int]:
    """Träff's receive schedule of node ``r``: the block, relative to its phase of ``q`` rounds,
    that ``r`` receives from ``r − s_k`` in round ``k`` of every phase. It holds ``r``'s base
    block and, for each other round index ``e``, block ``e − q`` (from the previous phase), so
    ``r`` gets one block of each residue mod ``q`` per phase; Träff (2023) proves that the
    sender always holds it already."""
    q = len(skips) - 1
    nodes = skips[q]
    base = _base_block(r, skips)
    # The candidate round indices, q down to 0, as a circular list through the head -1.
    after = {e: e - 1 for e in range(q + 1)} | {-1: q}
    before = {e: e + 1 for e in range(q)} | {q: -1, -1: 0}

    def take(e: int) -> None:
        after[before[e]] = after[e]
        before[after[e]] = before[e]

    take(base)
    got = [0] * q
    target = nodes + r

    # Depth-first over the sums of distances, the paths a block takes from node 0 (towards
    # r + N + 1, so paths that wrap around count too), handing out the round indices left to
    # rounds 0, 1, … in turn.
    def search(reached: int, bound: int, e: int, k: int) -> int:
        while e != -1:
            hop = reached + skips[e]
            if hop <= target - skips[k] and hop < bound:
                if hop <= target - skips[k + 1]:
                    k = search(hop, bound, e, k)
                if reached > target - skips[k + 1]:
                    return k
                bound = hop
                got[k] = e
                k += 1
                take(e)
            e = after[e]
        return k

    search(0, 2 * nodes, q, 0)
    return [base if e == q else e - q for e in got]
