"""Predicted time to first token, with rates learned online from what the router sees.

The model (all terms in seconds):

- compute on engine ``e``: ``overhead_e + rate_e * (queued_prompt_tokens_e + tokens_to_compute)
  + in_flight_e * in_flight_s``. The engine prefills what is queued before ours, then
  ours; running requests interleave decode steps with our prefill.
- pull of ``k`` tokens from source ``s`` into ``e``: ``base_s + per_token_s * k``, plus,
  when ``s`` is running requests, its *serve wait* and a busy-source cost. A vLLM engine
  answers a peer's lookup between two of its steps, and the step running when the lookup
  arrives prefills what is queued, up to one step's token budget (``step_tokens``), so the
  serve wait is the source's own compute line at that many tokens (a step that only
  decodes costs the line's base). The busy-source
  cost is what remains (where engines share cores, serving a pull competes with the
  source's prefill): an EWMA of the excess of such pulls over the idle prediction plus the
  serve wait, from the ``source_busy_s`` prior. Plus ``cold_session_s`` for the first
  pull between the pair (handshake, data-plane registration).

A source's pulls share its link: the router books each pull it plans on its source
(:meth:`CostModel.reserve_pull`, the transfer by the source's line, after those already
booked), and a quote adds the wait until the source's link is free of them
(:meth:`CostModel.queue_s`); the residual a pull teaches is net of the wait it was
quoted. A popular holder's pulls then queue in the prediction as they do on its NIC,
instead of teaching the fleet that busy sources are slow (docs/fleet.md, finding 5).

Each source has its own busy-source cost once a pull from it while busy was seen; until
then it is quoted the fleet's (every source's busy pulls). One holder whose NIC or cores
are queued must not make the fleet's other holders look slow (docs/fleet.md, finding 5).

A pull also costs the *consumer* engine steps that computing would not: vLLM's tiered
manager starts the promotion in the step that sees the hit, learns it finished in a later
one, and loads into the KV cache in the next (:data:`CONSUMER_PULL_STEPS`); an engine
running kvpeer's connector and manager (engine key ``sync_pulls``) takes none. On an idle
consumer those steps are nearly free; on a busy one each is a step of someone else's
prefill, up to one step's budget: :meth:`CostModel.consumer_steps_s` is that many of the
consumer's steps at its queue, zero when it runs nothing. It is added to every pull's
prediction and taken out of a pull's residual before the pull line learns it.

A consumer whose tier pulls ahead (engine key ``ahead``: the router's prefetch starts the
pull when it sends the request, kvpeer.node.ahead) pays only the part of a pull longer
than its queue wait, the consumer's compute of nothing at its load
(:meth:`CostModel.pull_hidden_s`): ``max(0, pull - wait)`` in the prediction. A residual
of such a pull is the pull less that wait; a residual of zero or less says only that the
pull hid, and teaches the pull line nothing.

The busy-source costs are only learned from pulls from busy sources, which the model
stops planning once it has learned that they are slow; so they relax toward their prior
with a half-life of ``stale_half_life_s`` seconds (:meth:`CostModel.relax`): a bad
experience is not believed for ever.

An engine with fewer than ``own_samples`` observations of its own is predicted by the
fleet's pooled compute line (every engine's observations): engines of one fleet mostly
run one model on one kind of machine, and an engine that has only pulled so far would
otherwise be judged by the prior alone. Pulls likewise: a source with fewer than
``own_samples`` pulls learned is quoted the fleet's pooled pull line. In a fleet each
source is pulled from rarely, and a line that had learned from two warm idle pulls
(the rest were busy or first pulls) was three times the true cost in the fleet model.

A source that answers without its engine (PD's parked supply) is quoted its line
alone, busy or not: no serve wait and no busy-source cost. A source with held blocks
answers so only the lookups whose keys are all in its held copy (at most a quarter of
its CPU tier); the rest wait for its engine as without held blocks. Its quote adds the
busy-source cost and serve wait weighted by the share it misses, ``1 - held``
(``held``: the share of its peers' lookups it answered from held blocks lately,
kvpeer.router.heldshare): ``held`` 1 is quoted like parked supply, 0 like a source
without held blocks (issue 37: a pull from a busy producer predicted at 0.10 s waited
4.3 s for its engine).

A kvpeer tier bounds that wait: a lookup its held blocks miss waits for its busy engine
at most ``engine_wait_s``, then is answered misses and the consumer computes
(kvpeer.node.enginewait). So the missed share of such a source's pulls costs at most
that bound plus computing the pulled tokens (:meth:`CostModel.engine_wait_bound`): the
bound its engine reports on its ``/metrics`` (:attr:`EngineLoad.engine_wait_s`;
``inf``, a tier configured without one: not bounded), else, for a source named
``held``, the prior :attr:`CostPriors.engine_wait_s` (the tier's default).

What a pull's residual teaches (:meth:`CostModel.observe_pull`): the first pull between
a pair teaches the cold-session penalty (its excess over the warm quote, less the busy
terms if it waited); a warm pull from a busy source that had to serve it with its
engine teaches the busy-source costs (its excess over the line and the serve wait) and
nothing else; every other warm pull teaches the pull lines (the source's and the pooled
one). A pull from a busy source with ``0 < held < 1`` is taken for one that waited when
its residual exceeds its quote without the busy terms (the line, and the cold-session
penalty for a pair's first pull) by half the serve wait or more (:data:`WAITED`),
else for one answered from held blocks: each teaches what the part of the quote it
stands for predicts. With held blocks on by default most pulls come from busy sources:
a line that learned only from idle ones hardly learned, and one that learned from the
same residuals as a busy cost split them at random between the two.

``(overhead_e, rate_e)`` and ``(base_s, per_token_s)`` are straight lines fitted by
exponentially weighted least squares (:class:`Line`): each observation counts a little
less every time a newer one arrives, and the priors act as pseudo-observations that
keep the fit sane before data arrives and fade as it does. The cold-session penalty is
an EWMA of the excess of first pulls over the warm prediction. The priors make a pull
win only when it saves clearly more than a round trip and a session set-up. (A pulled
request also costs the consumer engine extra scheduler steps - one for the lookup's
answer, one for the promotion into the CPU tier, one for the load into the KV cache -
which the learned pull line absorbs; a prior that counted them up front, 50 ms, kept
real engines from pulling a 448-token prefix before anything was learned.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpeer.router.policy import MAX_ENGINE_WAIT_S, EngineLoad

__all__ = ["CONSUMER_PULL_STEPS", "WAITED", "CostModel", "CostPriors", "Line"]

CONSUMER_PULL_STEPS = 2  # engine steps a pull adds on the consumer: promote, then load
#: A pull from a source whose held blocks answer only part of its lookups waited for
#: its engine if its residual exceeds its quote without the busy terms by this share
#: of the serve wait.
WAITED = 0.5


@dataclass(frozen=True, slots=True)
class CostPriors:
    overhead_s: float = 0.02  # per request on an idle engine: HTTP, scheduling, one step
    prefill_s_per_token: float = 2e-4
    in_flight_s: float = 0.005  # each running request's decode share of our prefill steps
    pull_base_s: float = 0.01  # lookup round trip + fetch set-up on a warm session
    pull_s_per_token: float = 2e-5
    cold_session_s: float = 0.05
    source_busy_s: float = 0.02
    # Prompt tokens one engine step prefills at most (vLLM's chunked-prefill budget,
    # max_num_batched_tokens: 2,048 by default): a serve window comes after the step under way.
    step_tokens: int = 2048
    tokens_ref: float = 1024.0  # where the prior line's second pseudo-point sits
    prior_weight: float = 4.0  # pseudo-observations behind each prior line
    half_life: float = 50.0  # observations after which one counts half
    cold_alpha: float = 0.2
    own_samples: int = 8  # an engine's own compute line is used from this many on
    stale_half_life_s: float = 60.0  # the busy-source cost relaxes toward its prior
    # A kvpeer tier answers a lookup its held blocks miss within its engine_wait_s
    # (0.25 s by default) of its engine's step, and the consumer computes the blocks
    # (kvpeer.node.enginewait): what such a miss costs at most, with that compute.
    # The bound a source's engine reports replaces it (EngineLoad.engine_wait_s).
    engine_wait_s: float = 0.25


class Line:
    """``y = a + b * x`` by exponentially weighted least squares with a prior line.

    ``a >= 0`` and ``b >= min_slope`` always hold: a negative time or rate would make a
    busier engine look faster.
    """

    def __init__(
        self, a: float, b: float, *, x_ref: float, weight: float, half_life: float,
        min_slope: float = 1e-9,
    ) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._min_slope = min_slope
        half = weight / 2.0
        y_ref = a + b * x_ref
        # Two prior pseudo-points, (0, a) and (x_ref, a + b * x_ref), weight/2 each.
        self._prior = (weight, half * x_ref, half * x_ref * x_ref, half * (a + y_ref),
                       half * x_ref * y_ref)
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # w, x, xx, y, xy of the observations
        self.samples = 0
        self._params = (a, b)

    def observe(self, x: float, y: float) -> None:
        d = self._decay
        w, sx, sxx, sy, sxy = self._sums
        self._sums = (w * d + 1.0, sx * d + x, sxx * d + x * x, sy * d + y, sxy * d + x * y)
        self.samples += 1
        self._params = self._solve()

    @property
    def params(self) -> tuple[float, float]:
        return self._params

    def predict(self, x: float) -> float:
        a, b = self._params
        return a + b * x

    def _solve(self) -> tuple[float, float]:
        w, sx, sxx, sy, sxy = (p + s for p, s in zip(self._prior, self._sums, strict=True))
        det = w * sxx - sx * sx
        b = (w * sxy - sx * sy) / det if det > 0 else self._params[1]
        b = max(b, self._min_slope)
        a = (sy - b * sx) / w
        if a < 0.0:  # refit the slope through the origin
            a = 0.0
            b = max(sxy / sxx if sxx > 0 else b, self._min_slope)
        return a, b


def _miss(held: float) -> float:
    """The share of a source's lookups its engine serves (``held`` clamped to 0..1)."""
    return 1.0 - min(1.0, max(0.0, held))


class CostModel:
    """Per-engine compute lines, per-source pull lines, cold sessions per pair."""

    def __init__(self, priors: CostPriors | None = None) -> None:
        self.priors = priors or CostPriors()
        self._compute: dict[str, Line] = {}
        self._pooled = self._new_compute_line()
        self._pull: dict[str, Line] = {}
        self._pooled_pull = self._new_pull_line()
        self._cold_s = self.priors.cold_session_s
        self._busy_s = self.priors.source_busy_s  # the fleet's, for sources not yet seen busy
        # Each source's own busy cost, kept as (cost - prior) / _busy_scale: relaxing
        # them all is one multiplication of the scale (relax()).
        self._busy: dict[str, float] = {}
        self._busy_scale = 1.0
        self._busy_at: float | None = None  # when the busy costs were last relaxed
        self._now = 0.0  # the time of the plan being made (relax())
        self._link_free_at: dict[str, float] = {}  # when each source's booked pulls end
        self._warm: set[tuple[str, str]] = set()
        self._warm_sources: frozenset[str] | None = None  # of _warm, until it changes
        self._floor_s: float | None = None  # pull_floor_s(), until a pull line learns
        self._compute_floor: tuple[float, float] | None = None  # compute_floor_s()'s line

    # --- predictions ------------------------------------------------------------------

    def compute_s(self, engine: str, tokens: int, load: EngineLoad) -> float:
        """Seconds until ``engine`` has prefilled ``tokens`` of ours, given its load."""
        ahead = max(0, load.queued_prompt_tokens) + max(0, tokens)
        line = self._quoted_compute_line(engine)
        return line.predict(ahead) + max(0, load.in_flight) * self.priors.in_flight_s

    def compute_floor_s(self, tokens: int, load: EngineLoad) -> float:
        """No engine's :meth:`compute_s` at this load is less: the same sum over the least
        base and rate of any compute line, so a decision can pass over engines that
        cannot win without predicting each one."""
        a, b = self._floor_line()
        ahead = max(0, load.queued_prompt_tokens) + max(0, tokens)
        return a + b * ahead + max(0, load.in_flight) * self.priors.in_flight_s

    def consumer_steps_floor_s(self, load: EngineLoad) -> float:
        """No :meth:`consumer_steps_s` of an engine without ``sync`` pulls at this load
        is less (the floor line at its serve wait): a decision's bound on a pull then
        says what the pull costs the busy consumer, and passes over more engines."""
        if load.in_flight <= 0:
            return 0.0
        a, b = self._floor_line()
        tokens = min(max(0, load.queued_prompt_tokens), self.priors.step_tokens)
        return CONSUMER_PULL_STEPS * (a + b * tokens)

    def pull_s(
        self, engine: str, source: str, tokens: int, source_load: EngineLoad, *,
        parked: bool = False, held: float = 0.0, bounded: bool = False,
    ) -> float:
        """Seconds for ``engine`` to pull ``tokens`` from ``source``'s CPU tier.

        ``parked``: a PD pull, served from what the prefill leg stored for it without
        waiting for the source's engine (no serve wait); ``held``: the share of its
        peers' lookups the source answers from held blocks on its node's thread (that
        share of pulls waits for no serve window either; 0: none held); ``bounded``: the
        source is a kvpeer tier, which waits for its busy engine at most
        ``engine_wait_s`` before the consumer computes (the rest of the pulls cost at
        most that and the compute): the prior when ``source_load`` reports no bound of
        its own (:meth:`engine_wait_bound`)."""
        warm, cold = self.pull_quote_s(source, tokens, source_load, parked=parked, held=held,
                                       bounded=bounded)  # fmt: skip
        return warm if (engine, source) in self._warm else cold

    def pull_quote_s(
        self, source: str, tokens: int, source_load: EngineLoad, *,
        parked: bool = False, held: float = 0.0, bounded: bool = False,
    ) -> tuple[float, float]:
        """:meth:`pull_s` into any engine: (its session with ``source`` warm, cold). A
        decision asks once per source and prefix, not once per consumer."""
        seconds = self._quoted_line(source).predict(max(0, tokens)) + self.queue_s(source)
        miss = _miss(held)
        if source_load.in_flight > 0 and not parked and miss > 0.0:
            wait = self.busy_s(source) + self.serve_wait_s(source, source_load)
            bound = self.engine_wait_bound(source_load.engine_wait_s, bounded=bounded)
            if bound is not None:  # compute on the source's line: the consumer's, in a like fleet
                wait = min(wait, bound + self._quoted_compute_line(source).predict(max(0, tokens)))
            seconds += miss * wait
        return seconds, seconds + self._cold_s

    def engine_wait_bound(self, reported: float | None, *, bounded: bool) -> float | None:
        """How long a busy source's tier makes a pull it cannot answer held wait for its
        engine at most, as quotes take it; None: not bounded. ``reported``: the bound
        the source's engine reports (``inf``: none), used whatever ``bounded`` says (a
        tier that reports one is a kvpeer tier); a value no tier can have (NaN,
        negative, past :data:`~kvpeer.router.policy.MAX_ENGINE_WAIT_S`) is not a
        report. Not reported: the prior if ``bounded`` (a source named ``held``)."""
        if reported is not None:
            if reported == math.inf:
                return None
            if 0.0 <= reported <= MAX_ENGINE_WAIT_S:
                return reported
        return self.priors.engine_wait_s if bounded else None

    def pull_floor_s(self) -> float:
        """No :meth:`pull_s` is less (each adds only non-negative terms to a pull line,
        which is at least its base at zero tokens, and, while no session is warm, the
        cold-session penalty): lets a decision skip the engines a pull cannot make
        fastest without predicting their pulls."""
        if self._floor_s is None:
            bases = [line.params[0] for line in (self._pooled_pull, *self._pull.values())]
            floor = min([self.priors.pull_base_s, *bases])
            self._floor_s = floor if self._warm else floor + self._cold_s
        return self._floor_s

    def consumer_steps_s(self, engine: str, load: EngineLoad, *, sync: bool = False) -> float:
        """What a pull's extra steps cost ``engine`` itself, given its load (zero idle);
        ``sync``: the engine runs kvpeer's connector and manager, which land a pull in
        the step that looked it up (no extra step)."""
        return 0.0 if sync else CONSUMER_PULL_STEPS * self.serve_wait_s(engine, load)

    def pull_hidden_s(self, engine: str, load: EngineLoad, *, ahead: bool) -> float:
        """How much of a pull into ``engine`` hides behind its queue: with ``ahead`` (its
        tier fetches when the router sends the request, kvpeer.node.ahead) the pull runs
        while the request waits for the requests ahead of it; the prediction of that wait
        is ``engine``'s compute of nothing of ours at this load. Zero without."""
        return self.compute_s(engine, 0, load) if ahead else 0.0

    def serve_wait_s(self, source: str, source_load: EngineLoad) -> float:
        """How long a busy ``source``'s engine takes to reach its next serve window."""
        if source_load.in_flight <= 0:
            return 0.0
        # The step under way prefills the queue; a decode-only step is the line's base.
        line = self._quoted_compute_line(source)
        return line.predict(min(max(0, source_load.queued_prompt_tokens), self.priors.step_tokens))

    def queue_s(self, source: str) -> float:
        """How long pulls already booked on ``source`` keep its link busy from now."""
        free = self._link_free_at.get(source)
        return 0.0 if free is None else max(0.0, free - self._now)

    def reserve_pull(self, source: str, tokens: int) -> float:
        """Book a planned pull of ``tokens`` on ``source``'s link, after those booked
        already; returns the wait it was quoted (:meth:`queue_s`), for its outcome."""
        wait = self.queue_s(source)
        transfer = self._quoted_line(source).predict(max(0, tokens))
        self._link_free_at[source] = self._now + wait + transfer
        return wait

    def busy_s(self, source: str) -> float:
        """What pulling from ``source`` costs while it is busy, beyond its line and its
        serve wait: its own learned cost, or the fleet's until it has one."""
        own = self._busy.get(source)
        if own is None:
            return self._busy_s
        return self.priors.source_busy_s + own * self._busy_scale

    def is_warm(self, engine: str, source: str) -> bool:
        return (engine, source) in self._warm

    def warm_source(self, source: str) -> bool:
        """Whether some engine's session with ``source`` is warm: if none is, every pull
        from it is quoted cold."""
        if self._warm_sources is None:
            self._warm_sources = frozenset(source for _, source in self._warm)
        return source in self._warm_sources

    def relax(self, now: float) -> None:
        """Let the busy-source costs drift toward their prior, at ``stale_half_life_s``;
        ``now`` is also the time of the plan being made (:meth:`queue_s`)."""
        self._now = now
        if self._busy_at is None or now <= self._busy_at:
            self._busy_at = now if self._busy_at is None else self._busy_at
            return
        keep = 0.5 ** ((now - self._busy_at) / self.priors.stale_half_life_s)
        prior = self.priors.source_busy_s
        self._busy_s = prior + (self._busy_s - prior) * keep
        self._busy_scale *= keep
        if self._busy_scale < 1e-9:  # renormalise before the scale underflows
            self._busy = {source: own * self._busy_scale for source, own in self._busy.items()}
            self._busy_scale = 1.0
        self._busy_at = now

    # --- learning ---------------------------------------------------------------------

    def observe_compute(self, engine: str, tokens: int, load: EngineLoad, seconds: float) -> None:
        """``engine`` took ``seconds`` to its first token computing ``tokens`` itself."""
        ahead = max(0, load.queued_prompt_tokens) + max(0, tokens)
        y = max(0.0, seconds - max(0, load.in_flight) * self.priors.in_flight_s)
        self._compute_floor = None
        self._compute_line(engine).observe(ahead, y)
        self._pooled.observe(ahead, y)

    def observe_pull(
        self, engine: str, source: str, tokens: int, source_load: EngineLoad, seconds: float,
        *, parked: bool = False, held: float = 0.0, queued_s: float = 0.0,
    ) -> None:
        """A pull of ``tokens`` from ``source`` took ``seconds`` (residual of the TTFT),
        ``queued_s`` of them waiting for pulls booked before it (:meth:`reserve_pull`);
        ``parked`` and ``held`` as for :meth:`pull_s`; what it teaches is in the module
        docstring."""
        self._floor_s = None
        seconds -= max(0.0, queued_s)
        quoted = self._quoted_line(source).predict(tokens)
        # Busy as a pull sees it: its source's engine ran requests and had to serve it
        # (with some lookups held: it took long enough to have waited, WAITED).
        miss = _miss(held)
        busy = source_load.in_flight > 0 and not parked and miss > 0.0
        wait = self.serve_wait_s(source, source_load) if busy else 0.0
        cold = (engine, source) not in self._warm
        if busy and miss < 1.0:  # its quote, cold or warm, was passed by WAITED * wait
            busy = seconds - quoted - (self._cold_s if cold else 0.0) >= WAITED * wait
            wait = wait if busy else 0.0
        alpha = self.priors.cold_alpha
        if cold:
            self._warm.add((engine, source))
            self._warm_sources = None
            extra = self.busy_s(source) + wait if busy else 0.0
            excess = seconds - quoted - extra
            self._cold_s = max(0.0, (1 - alpha) * self._cold_s + alpha * excess)
            return
        if busy:
            excess = seconds - quoted - wait
            self._busy_s = max(0.0, (1 - alpha) * self._busy_s + alpha * excess)
            # A source's own cost starts from the prior: the fleet's is only a guess
            # for sources not yet seen.
            own = self._busy.get(source)
            before = self.priors.source_busy_s if own is None else self.busy_s(source)
            learned = max(0.0, (1 - alpha) * before + alpha * excess)
            self._busy[source] = (learned - self.priors.source_busy_s) / self._busy_scale
            return
        y = max(0.0, seconds)
        self._pull_line(source).observe(tokens, y)
        self._pooled_pull.observe(tokens, y)

    def forget_sessions(self, engine: str) -> None:
        """``engine`` restarted: its kvpeer sessions are new, so its pairs are cold."""
        self._warm = {pair for pair in self._warm if engine not in pair}
        self._link_free_at.pop(engine, None)
        self._warm_sources = None
        self._floor_s = None

    def rates(self) -> dict[str, float]:
        """The learned parameters, as plain numbers for export."""
        out: dict[str, float] = {"cold_session_s": self._cold_s, "source_busy_s": self._busy_s}
        out["overhead_s:*"], out["prefill_s_per_token:*"] = self._pooled.params
        for name, line in sorted(self._compute.items()):
            a, b = line.params
            out[f"overhead_s:{name}"] = a
            out[f"prefill_s_per_token:{name}"] = b
        out["pull_base_s:*"], out["pull_s_per_token:*"] = self._pooled_pull.params
        for name, line in sorted(self._pull.items()):
            a, b = line.params
            out[f"pull_base_s:{name}"] = a
            out[f"pull_s_per_token:{name}"] = b
        for name in sorted(self._busy):
            out[f"source_busy_own_s:{name}"] = self.busy_s(name)
        return out

    def _floor_line(self) -> tuple[float, float]:
        """The least base and the least rate of any compute line (and the prior's)."""
        if self._compute_floor is None:
            lines = [self._pooled.params, *(line.params for line in self._compute.values())]
            p = self.priors
            self._compute_floor = (min([p.overhead_s, *(a for a, _ in lines)]),
                                   min([p.prefill_s_per_token, *(b for _, b in lines)]))
        return self._compute_floor

    def _new_compute_line(self) -> Line:
        p = self.priors
        return Line(p.overhead_s, p.prefill_s_per_token, x_ref=p.tokens_ref,
                    weight=p.prior_weight, half_life=p.half_life)

    def _compute_line(self, engine: str) -> Line:
        line = self._compute.get(engine)
        if line is None:
            line = self._compute[engine] = self._new_compute_line()
        return line

    def _new_pull_line(self) -> Line:
        p = self.priors
        return Line(p.pull_base_s, p.pull_s_per_token, x_ref=p.tokens_ref,
                    weight=p.prior_weight, half_life=p.half_life)

    def _pull_line(self, source: str) -> Line:
        line = self._pull.get(source)
        if line is None:
            line = self._pull[source] = self._new_pull_line()
        return line

    def _quoted_compute_line(self, engine: str) -> Line:
        """``engine``'s own compute line once learned, else the fleet's pooled one."""
        return self._own_or_pooled(self._compute.get(engine), self._pooled)

    def _quoted_line(self, source: str) -> Line:
        """``source``'s own pull line once learned, else the fleet's pooled one."""
        return self._own_or_pooled(self._pull.get(source), self._pooled_pull)

    def _own_or_pooled(self, own: Line | None, pooled: Line) -> Line:
        """``own`` once it has ``own_samples`` observations, else ``pooled``."""
        if own is None or own.samples < self.priors.own_samples:
            return pooled
        return own
