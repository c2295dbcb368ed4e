"""How far apart two modes' speeds are, from their repeats (torch-free: the driver and the tests read it).

The driver runs the modes in rounds (A B C, A B C, ...), so every mode's repeats are spread alike over the
run and a drift in the machine's load reaches all of them. From the tokens/s of every repeat:
  spread        one mode's repeats: lowest, median (the lower middle one, a repeat that really ran), highest
  round ratios  a mode over a baseline (DDP, FSDP2) round by round: each round's two runs were neighbours in
                time, so the ratio's spread is that of the rounds' ratios, not of two independent ranges
  verdict       two modes are told apart when their ranges of tokens/s do not overlap: every repeat of one
                faster than every repeat of the other. Were the two equally fast, with their repeats
                interchangeable, that happens by chance with probability 2 / C(m + n, m) (m, n repeats:
                10% at 3 each, 0.8% at 5, 0.06% at 7), whatever the distribution of the noise; fewer than
                MIN_REPEATS repeats are not enough to tell.
benchmarks/README.md says why this rule and not a bootstrap interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_REPEATS = 3  # 2 / C(6, 3) = 10%: below it, ranges apart say little
RATIO_BASELINES = ("ddp", "fsdp2")  # each zerodp mode is compared with these (pairs_that_matter)


@dataclass(frozen=True)
class Spread:
    """Lowest, median and highest of n values."""

    n: int
    low: float
    median: float
    high: float

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high


def spread(values: Sequence[float]) -> Spread:
    """The values' spread; the median is the lower middle value for an even count (one that really ran)."""
    if not values:
        raise ValueError("spread of no values: a mode needs at least one measured repeat")
    ordered = sorted(values)
    return Spread(len(ordered), ordered[0], ordered[(len(ordered) - 1) // 2], ordered[-1])


def round_ratios(mine: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """mine[i] / theirs[i] for each round i: the two modes' tokens/s of the same round."""
    if len(mine) != len(theirs):
        raise ValueError(f"round ratios need one value per round from each mode, got {len(mine)} and {len(theirs)}")
    return [a / b for a, b in zip(mine, theirs)]


def chance_if_equal(m: int, n: int) -> float:
    """The probability that m and n interchangeable repeats fall into ranges that do not overlap (either order)."""
    return 2 / math.comb(m + n, m)


@dataclass(frozen=True)
class Verdict:
    """Whether `mode` and `other` can be told apart at the spread of their repeats."""

    mode: str
    other: str
    mine: Spread              # tokens/s of mode's repeats
    theirs: Spread            # tokens/s of other's repeats
    ratio: Spread             # mode over other, round by round
    told_apart: bool
    chance_if_equal: float    # of ranges this far apart by chance, were the two equally fast

    def sentence(self) -> str:
        ranges = (f"{self.mine.low:,.0f}-{self.mine.high:,.0f} against {self.theirs.low:,.0f}-{self.theirs.high:,.0f} "
                  f"tokens/s")
        head = (f"{self.mode} vs {self.other}: {self.ratio.median:.2f}x "
                f"({self.ratio.low:.2f}-{self.ratio.high:.2f} over {self.ratio.n} rounds)")
        if self.told_apart:
            faster = self.mode if self.mine.median > self.theirs.median else self.other
            return (f"{head}, told apart: {faster} is faster (ranges {ranges} do not overlap; "
                    f"{self.chance_if_equal:.1%} chance of that were the two equally fast)")
        if min(self.mine.n, self.theirs.n) < MIN_REPEATS:
            return f"{head}, cannot be told apart with {min(self.mine.n, self.theirs.n)} repeats ({MIN_REPEATS} needed)"
        return f"{head}, cannot be told apart (ranges {ranges} overlap)"


def tell_apart(mode: str, mine: Sequence[float], other: str, theirs: Sequence[float]) -> Verdict:
    """The verdict on two modes from their tokens/s, one value per round each (the rounds in order)."""
    a, b = spread(mine), spread(theirs)
    enough = min(a.n, b.n) >= MIN_REPEATS
    return Verdict(mode, other, a, b, spread(round_ratios(mine, theirs)), enough and not a.overlaps(b),
                   chance_if_equal(a.n, b.n))


def pairs_that_matter(modes: Sequence[str]) -> list[tuple[str, str]]:
    """Each zerodp mode against each baseline (RATIO_BASELINES) among `modes`, in the order of `modes`."""
    return [(m, base) for m in modes if m.startswith("zerodp") for base in RATIO_BASELINES if base in modes]
