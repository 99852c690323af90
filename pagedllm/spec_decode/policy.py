"""Whether a step speculates: speculation pays when checking k drafts costs less than the tokens it saves.

At batch 1 a decode step is bound by reading the weights, and checking 4 more tokens costs little more than
one; in a large batch the step is bound by compute, each draft token costs nearly as much as a real one, and
rejected drafts are pure loss (vLLM measured 1.4-1.8x slowdowns at high load). So each step compares, from
numbers measured on this machine as it runs:
    tokens out per request:  E = 1 + P(first draft kept) * (drafts kept when the first is)
    step time:               T(n) for a step of n tokens, interpolated between the sizes of recent steps (decode
                             steps, prefill chunks: every step is a sample)
and checks drafts when that raises the expected tokens per second by the margin. Drafts come in runs (inside a
span the output copies, every draft is kept; outside it, the first is wrong), which a per-token acceptance rate
averages away: hence the two factors, the first per request (its last few drafts), the second over all.
No step is spent exploring the expensive choice: drafts that are not checked are still compared with the token
the step then writes (was the first draft that token?), which keeps each request's estimate current while
speculation is off. Before any step is timed, it speculates."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pagedllm.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

MARGIN = 0.05  # speculate only when it is expected to be at least this much faster
# A choice expected within this factor of no drafts is tried again when its step size's time is this old: a
# stale, high step time is otherwise never measured again.
REFRESH_WITHIN, REFRESH_AFTER_STEPS = 0.8, 64
PROBE_EVERY = 8  # a draft model proposes one draft every this many steps while drafts are not checked
_DECAY = 0.8  # weight of the old value in the moving averages
_REQUEST_DECAY = 0.8  # a request's own record: its last few first drafts (drafts come in runs)
_PRIOR_WEIGHT = 5.0  # the overall rate counts as this many of a request's own first drafts (its decayed window: 5)


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode metrics): verify passes (requests with drafts in a step), draft
    tokens proposed and checked, those accepted, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    steps_on: int = 0  # steps whose rule said speculate
    steps_off: int = 0  # steps with drafts that the rule (or disable_by_batch_size) ran without them

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


def expected_tokens(first_kept: float, kept_after_first: float, k: int | float) -> float:
    """Tokens a request gets from a step with k drafts: 1, plus the drafts kept (`kept_after_first` of them, at
    most k, when the first one is, which happens with probability `first_kept`)."""
    return 1.0 + first_kept * min(kept_after_first, k)


def _bucket(num_tokens: int) -> int:
    return 1 << max(0, num_tokens - 1).bit_length()


class StepTimes:
    """Moving averages of step time by power-of-two step size (and of the sizes in each), and T(n) between them."""

    def __init__(self) -> None:
        self._points: dict[int, tuple[float, float]] = {}  # bucket -> (mean tokens, mean seconds)
        self._sorted: list[tuple[float, float]] = []  # the points by size (seconds() runs per candidate per step)
        self._updated: dict[int, int] = {}  # bucket -> the step count when it was last measured
        self.steps = 0

    def record(self, num_tokens: int, seconds: float) -> None:
        b = _bucket(num_tokens)
        old = self._points.get(b)
        self._points[b] = (num_tokens, seconds) if old is None else \
            (_DECAY * old[0] + (1 - _DECAY) * num_tokens, _DECAY * old[1] + (1 - _DECAY) * seconds)
        self._sorted = sorted(self._points.values())
        self.steps += 1
        self._updated[b] = self.steps

    def age(self, num_tokens: int) -> int | None:
        """Steps since a step of this size's bucket was last measured (None: never)."""
        updated = self._updated.get(_bucket(num_tokens))
        return None if updated is None else self.steps - updated

    def __bool__(self) -> bool:
        return bool(self._points)

    def seconds(self, num_tokens: int) -> float | None:
        """T(num_tokens): linear between the two measured sizes around it; below the smallest, the smallest's time;
        above the largest, the largest's time per token (steps that large are compute-bound)."""
        points = self._sorted
        if not points:
            return None
        if num_tokens <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if num_tokens <= n1:
                return t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0) if n1 > n0 else t1
        n, t = points[-1]
        return t * num_tokens / n


class SpeculationPolicy:
    """The per-step rule (the scheduler asks `select`; the engine reports each step's time and each check).
    Each step, the requests with drafts are taken in order of their chance that the first draft is kept, and the
    set that maximises expected tokens per second (if it beats no drafts by the margin) checks its drafts; the
    others decode one token."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats()
        # Decaying sums: first drafts kept / looked at (checked or not), and drafts kept / checks whose first draft
        # was kept. Until measured: half the first drafts, and half of a step's drafts after them.
        self._first = (0.5, 1.0)
        self._run = (config.num_speculative_tokens / 2, 1.0)
        self.step_times = StepTimes()
        self._last: bool | None = None
        self._steps_off = 0  # steps asked for drafts while the rule was off (a draft model's probes)

    @property
    def lookahead(self) -> int:
        """Positions past a request's next step its blocks must have room for: a draft model writes the K/V of
        its drafts there when it proposes them (n-gram drafts need none)."""
        return self.config.num_speculative_tokens if self.config.method == "draft_model" else 0

    def drafts_wanted(self) -> int:
        """How many drafts the proposer should make after the next step. N-gram drafts cost next to nothing: always
        all of them (the unchecked ones keep the estimates current). A draft model's cost a forward each: all of
        them while the rule checks drafts; while it does not, one every PROBE_EVERY steps (what its first draft
        would have kept still tells when to turn back on), none otherwise."""
        k = self.config.num_speculative_tokens
        if self.config.method != "draft_model" or self._last is not False:
            return k
        self._steps_off += 1
        return 1 if self._steps_off % PROBE_EVERY == 0 else 0

    def select(self, decoding: list) -> set[str]:
        """The ids of the decoding requests (Requests with `spec_token_ids`, one new token each) whose drafts this
        step checks."""
        drafted = [r for r in decoding if r.spec_token_ids]
        if not drafted:
            return set()
        cap = self.config.disable_by_batch_size
        if cap is not None and len(decoding) > cap:
            chosen = []
        elif not self.config.adaptive:
            chosen = drafted
        else:
            chosen = self._best(len(decoding), drafted)
        on = bool(chosen)
        if on != self._last and self._last is not None:
            drafts = sum(len(r.spec_token_ids) for r in drafted)
            logger.info("speculative decoding %s: %d decoding, %d with drafts (%d), first draft kept %.2f, then "
                        "%.1f more; step %s ms -> %s ms", "on" if on else "off", len(decoding), len(drafted), drafts,
                        self.first_kept, self.kept_after_first, self._ms(len(decoding)),
                        self._ms(len(decoding) + drafts))
        self._last = on
        if on:
            self.stats.steps_on += 1
        else:
            self.stats.steps_off += 1
        return {r.request_id for r in chosen}

    def _best(self, batch: int, drafted: list) -> list:
        """The prefix of `drafted` (most likely kept first) with the most expected tokens per second, if that beats
        no drafts by the margin; [] otherwise (or all of them before any step is timed)."""
        plain = self.step_times.seconds(batch)
        if plain is None:
            return drafted
        ranked = sorted(drafted, key=self.request_first_kept, reverse=True)
        plain_rate = batch / plain
        best, best_rate, tokens, drafts = 0, plain_rate * (1.0 + MARGIN), float(batch), 0
        closest, closest_rate = 0, 0.0  # the best set whatever the margin
        for i, r in enumerate(ranked, start=1):
            k = len(r.spec_token_ids)
            tokens += expected_tokens(self.request_first_kept(r), self.kept_after_first, k) - 1.0
            drafts += k
            rate = tokens / self.step_times.seconds(batch + drafts)
            if rate > best_rate:
                best, best_rate = i, rate
            if rate > closest_rate:
                closest, closest_rate, closest_size = i, rate, batch + drafts
        if not best and closest_rate > plain_rate * REFRESH_WITHIN:
            # Close, but the time of that step size may be stale (one slow step keeps it high, and it is not
            # measured again while off): check the drafts once when it has not been measured for a while.
            age = self.step_times.age(closest_size)
            if age is None or age > REFRESH_AFTER_STEPS:
                return ranked[:closest]
        return ranked[:best]

    def gain(self, batch: int, drafts: int) -> float | None:
        """Expected tokens per second with `drafts` drafts spread over the batch, over without them, at the overall
        rates (None: no step timed yet)."""
        plain, spec = self.step_times.seconds(batch), self.step_times.seconds(batch + drafts)
        if plain is None:
            return None
        return expected_tokens(self.first_kept, self.kept_after_first, drafts / batch) * plain / spec

    def _ms(self, num_tokens: int) -> str:
        t = self.step_times.seconds(num_tokens)
        return "?" if t is None else f"{t * 1e3:.1f}"

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` tokens took `seconds` (forward and sampling)."""
        if num_tokens >= 1:
            self.step_times.record(num_tokens, seconds)

    def record_verify(self, request, num_draft_tokens: int, num_accepted: int) -> None:
        """A request's drafts were checked: `num_accepted` of `num_draft_tokens` kept."""
        if num_draft_tokens < 1:
            return
        self.stats.record(num_draft_tokens, num_accepted)
        self._record_first(request, num_accepted > 0)
        if num_accepted:
            self._run = _decayed(self._run, num_accepted, 1.0)

    def record_unchecked(self, request, first_draft_kept: bool) -> None:
        """A request's drafts were not checked: whether its first draft is the token it then wrote."""
        self._record_first(request, first_draft_kept)

    def _record_first(self, request, kept: bool) -> None:
        self._first = _decayed(self._first, float(kept), 1.0)
        request.spec_acceptance = _decayed(request.spec_acceptance or (0.0, 0.0), float(kept), 1.0, _REQUEST_DECAY)

    def request_first_kept(self, request) -> float:
        """The chance that the request's next first draft is kept: its last few, with the overall rate as a prior."""
        hits, tries = request.spec_acceptance or (0.0, 0.0)
        return (hits + _PRIOR_WEIGHT * self.first_kept) / (tries + _PRIOR_WEIGHT)

    @property
    def first_kept(self) -> float:
        """How often a first draft is kept, over all requests, recently."""
        return self._first[0] / self._first[1]

    @property
    def kept_after_first(self) -> float:
        """Drafts kept in a check whose first draft is kept, recently."""
        return self._run[0] / self._run[1]


def _decayed(sums: tuple[float, float], value: float, count: float, decay: float = _DECAY) -> tuple[float, float]:
    return decay * sums[0] + value, decay * sums[1] + count
