"""An engine preset from measurements: ``kvpeer bench trace --probe``'s figures turned
into the fleet model's :class:`~kvpeer.lab.fleet.params.GpuModel` and a link.

The model's step is ``overhead + (tokens x 2 x params + attention) / flops`` (the memory
term off: a small model on a CPU computes, it does not wait for memory), and a request
reaches its engine ``request_overhead_s`` after it is sent. The probe (its rules in
:mod:`kvpeer.lab.bench.trace_probe`) gives, all on an idle engine:

1. ``prefill_ttft_s[L]``: one step of ``L`` fresh tokens (every probe length fits one step
   budget), so ``TTFT(L) = c0 + a L + b L^2`` with ``c0 = request + step overhead``,
   ``a = 2 params / flops``, ``b = attention_flops / (2 flops)``: a least-squares fit of
   ``c0, a, b`` gives ``flops`` and the attention cost per token per context position
   (as ``hidden``, layers kept), both effective figures of this machine.
2. ``decode_step_s["1"]``: one decode step of one short sequence, ``overhead + a``: the
   step overhead. ``hit_ttft_s``: a prompt whose full blocks the engine holds, so one
   step computes its last ``hit_prompt_tokens mod block`` tokens (a whole block if none):
   the request overhead is that TTFT less that step, as the engine alone computes it
   (never below zero).
3. ``pair_slowdown`` (probes that pair each round with a prefill alone), else
   ``pair_prefill_ttft_s[L]`` over ``prefill_ttft_s[L]``: how much slower an engine
   prefills while the other one does too (they share this machine's cores), at least
   1. With the front end probed (rule 5) the model shares the cores itself and this is
   ``co_run_slowdown``, applied only while both engines step (two one-thread engines
   on two cores do not share a core: what is left is what they cost each other).
   Without it (probes before rule 5), the effective FLOP/s of rule 1 is divided by it:
   in a window both engines are busy whenever it matters (a burst), so the preset is
   an engine of a busy pair. The overheads are not scaled.
4. ``pull_ttft_s[L]`` less ``hit_ttft_s`` (a prompt whose blocks the engine holds, the
   same compute after them): the pull of ``L`` tokens, ``setup + L x kv bytes / rate``:
   a straight line through those points gives the link's rate and set-up.
5. ``frontend`` (:mod:`kvpeer.lab.bench.frontend_probe`): the host's cores, and the CPU
   seconds of the API servers, the router and the sender (``FRONT_ROLES``) per request
   and per output token become ``host_cores``, ``frontend_s_per_request`` and
   ``frontend_s_per_token`` (:mod:`~kvpeer.lab.fleet.hostcpu`). A request's front-end
   CPU is then a stage of its own, so it is taken off rule 2's request overhead (never
   below zero).
6. ``long_prefill_cores_by_role`` (else ``prefill_cores_by_role``): the cores each
   engine's scheduler process used over the prefills alone, per core its worker used, is
   ``scheduler_cores`` (it runs while its
   worker steps, whatever the step holds). A probe without it (before rule 6) counts
   the scheduler's CPU per request and per token with the front end's instead. With
   rule 5 the pair's slowdown (rule 3) is first divided by what the model's sharing
   already predicts for two engines stepping at once (each ``1 + scheduler_cores``
   threads on ``host_cores``): ``co_run_slowdown`` is what is left (at least 1).

Figures not probed are the caller's (``base``): KV bytes per token, the KV memory, the
step budget, ``max_num_seqs``, the CPU tier; the model's shape (params, layers).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvpeer.errors import ConfigError
from kvpeer.lab.bench.serve_workloads import BLOCK_TOKENS
from kvpeer.lab.fleet.hostcpu import sharing_factor
from kvpeer.lab.fleet.params import GpuModel, LinkModel

__all__ = ["Calibration", "calibrate", "line_fit", "pooled_probe"]

#: rule 5's figures of a probe's ``frontend``: CPU by role, per request and per token
FRONTEND = ("cpu_s_per_request", "cpu_s_per_output_token")
#: rule 5's front end (and each engine's scheduler, ``core``, without rule 6's figure)
FRONT_ROLES = ("server", "router", "sender")
#: The memory term off: bandwidth no step waits for.
NO_MEMORY_BOUND = 1e18


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = c + m x``: (c, m)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ConfigError("a line needs two distinct points")
    mx, my = sum(xs) / n, sum(ys) / n
    m = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    return my - m * mx, m


def _quadratic_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares ``y = c + a x + b x^2`` (normal equations, Cramer's rule)."""
    if len(set(xs)) < 3:
        raise ConfigError("rule 1 needs three distinct prefill lengths")
    s = [sum(x**k for x in xs) for k in range(5)]
    t = [sum(y * x**k for x, y in zip(xs, ys, strict=True)) for k in range(3)]
    m = [[s[0], s[1], s[2]], [s[1], s[2], s[3]], [s[2], s[3], s[4]]]

    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))  # fmt: skip

    d = det(m)
    coef = []
    for col in range(3):
        swapped = [row[:] for row in m]
        for r in range(3):
            swapped[r][col] = t[r]
        coef.append(det(swapped) / d)
    return coef[0], coef[1], coef[2]


class Calibration:
    """The preset and link rules 1-6 give from one probe."""

    def __init__(self, probe: Mapping[str, Any], base: GpuModel, *, name: str) -> None:
        prefill = {int(k): float(v) for k, v in probe["prefill_ttft_s"].items()}
        lengths = sorted(prefill)
        c0, a, b = _quadratic_fit(lengths, [prefill[n] for n in lengths])
        if a <= 0:
            raise ConfigError(f"prefill TTFT does not grow with the prompt (a fit's cost "
                              f"per token is not positive): {prefill}")
        flops = base.flops_per_token / a
        attention = max(0.0, 2.0 * b * flops)  # per token per context position
        overhead = max(0.0, float(probe["decode_step_s"]["1"]) - a)
        slowdown = float(probe.get("pair_slowdown", _slowdown(probe)))
        front = probe.get("frontend") or {}
        shared = "cpu_s_per_request" in front  # rule 5
        alone = replace(
            base, name=name, peak_flops=flops, mfu=1.0,
            hidden=round(attention / (4.0 * base.layers)), hbm_bytes_s=NO_MEMORY_BOUND,
            hbm_efficiency=1.0, step_overhead_s=overhead,
        )
        bt = base_block_tokens(probe)
        held = int(probe.get("hit_prompt_tokens", lengths[-1]))
        last = held % bt or bt
        request = float(probe["hit_ttft_s"]) - alone.step_s([(last, held - last)], 0, 0)
        scheduler = _scheduler_cores(probe)
        if shared:
            roles = FRONT_ROLES + (() if scheduler is not None else ("core",))
            per_request = sum(float(front["cpu_s_per_request"][r]) for r in roles)
            per_token = sum(float(front["cpu_s_per_output_token"][r]) for r in roles)
            cores = int(front["cores"])
            threads = 2.0 * (1.0 + (scheduler or 0.0))  # rule 6: the pair's, stepping
            self.gpu = replace(
                alone, request_overhead_s=max(0.0, request - per_request),
                host_cores=cores, frontend_s_per_request=per_request,
                frontend_s_per_token=max(0.0, per_token), scheduler_cores=scheduler or 0.0,
                co_run_slowdown=max(1.0, slowdown / sharing_factor(threads, 0.0, cores)),
            )
        else:
            self.gpu = replace(alone, peak_flops=flops / slowdown,
                               request_overhead_s=max(0.0, request))
        self.fit = {"c0_s": c0, "a_s_per_token": a, "b_s_per_token2": b,
                    "pair_slowdown": slowdown}
        self.link: LinkModel | None = None
        line = probe.get("pull_line") or _pull_line(probe)
        if line is not None:
            setup, per_token = line
            self.link = LinkModel("shm", base.kv_bytes_per_token / per_token, 0.0,
                                  setup_s=max(0.0, setup))

    def figures(self) -> dict[str, float]:
        gpu = self.gpu
        out = {"prefill_tokens_s_2k": 2048 / gpu.prefill_alone_s(2048),
               "flops": gpu.peak_flops, "attention_hidden": float(gpu.hidden),
               "step_overhead_s": gpu.step_overhead_s,
               "request_overhead_s": gpu.request_overhead_s,
               "host_cores": float(gpu.host_cores),
               "frontend_s_per_request": gpu.frontend_s_per_request,
               "frontend_s_per_token": gpu.frontend_s_per_token,
               "scheduler_cores": gpu.scheduler_cores,
               "co_run_slowdown": gpu.co_run_slowdown, **self.fit}
        if self.link is not None:
            out["link_bytes_s"] = self.link.bytes_s
            out["link_setup_s"] = self.link.setup_s
        return out


def _scheduler_cores(probe: Mapping[str, Any]) -> float | None:
    """Rule 6 on one probe (or a pooled one's figure); None without it."""
    if "scheduler_cores" in probe:
        return float(probe["scheduler_cores"])
    cores = probe.get("long_prefill_cores_by_role") or probe.get("prefill_cores_by_role")
    if not cores or cores.get("worker", 0.0) <= 0:
        return None
    return float(cores["core"]) / float(cores["worker"])


def _slowdown(probe: Mapping[str, Any]) -> float:
    """Rule 3 on one probe: 1 if it has no pair figure."""
    if "pair_slowdown" in probe:  # taken in rounds beside its prefills alone
        return max(1.0, float(probe["pair_slowdown"]))
    prefill = probe["prefill_ttft_s"]
    shared = sorted((n for n in probe.get("pair_prefill_ttft_s", {}) if n in prefill), key=int)
    if not shared:
        return 1.0
    return max(1.0, float(probe["pair_prefill_ttft_s"][shared[-1]]) / float(prefill[shared[-1]]))


def _pull_line(probe: Mapping[str, Any]) -> tuple[float, float] | None:
    """Rule 4 on one probe: (set-up s, s per token), or None if it has fewer than two
    pulls or its line does not rise (noise larger than the pulls)."""
    pulls = {int(k): float(v) for k, v in probe.get("pull_ttft_s", {}).items()}
    if len(pulls) < 2:
        return None
    xs = sorted(pulls)
    setup, per_token = line_fit(xs, [pulls[n] - float(probe["hit_ttft_s"]) for n in xs])
    return (setup, per_token) if per_token > 0 else None


def base_block_tokens(probe: Mapping[str, Any]) -> int:
    """The engines' block (``kvpeer bench trace``'s: 32 tokens) unless the probe says."""
    return int(probe.get("block_tokens", BLOCK_TOKENS))


def pooled_probe(probes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One probe from several (each arm's of one or more ``kvpeer bench trace --json``'s
    ``probes``; a failed probe left out): each TTFT the median over the probes that
    measured it; the pair slowdown (rule 3) and the pull line (rule 4) are each probe's
    own, from figures measured minutes apart, and then the median over the probes that
    have one (``pull_line``: per figure, over the lines that rise); the front end's
    figures (rule 5) the median over the probes that have them."""
    good = [p for p in probes.values() if "error" not in p]
    if not good:
        raise ConfigError("no probe to calibrate from: run kvpeer bench trace --probe")
    out: dict[str, Any] = {"hit_ttft_s": statistics.median(p["hit_ttft_s"] for p in good)}
    if "hit_prompt_tokens" in good[0]:
        out["hit_prompt_tokens"] = good[0]["hit_prompt_tokens"]
    for key in ("prefill_ttft_s", "pair_prefill_ttft_s", "decode_step_s", "pull_ttft_s"):
        lengths = sorted({n for p in good for n in p.get(key, {})}, key=int)
        values = {n: statistics.median(p[key][n] for p in good if n in p.get(key, {}))
                  for n in lengths}
        if values:
            out[key] = values
    paired = [_slowdown(p) for p in good if p.get("pair_prefill_ttft_s")]
    out["pair_slowdown"] = statistics.median(paired) if paired else 1.0
    lines = [line for line in map(_pull_line, good) if line is not None]
    if lines:
        out["pull_line"] = [statistics.median(x[0] for x in lines),
                            statistics.median(x[1] for x in lines)]
    fronts = [p["frontend"] for p in good if "cpu_s_per_request" in p.get("frontend", {})]
    if fronts:  # rule 5: each figure the median over the probes that have it
        roles = set.intersection(*(set(f[FRONTEND[0]]) & set(f[FRONTEND[1]]) for f in fronts))
        out["frontend"] = {
            key: {role: statistics.median(f[key][role] for f in fronts) for role in sorted(roles)}
            for key in FRONTEND}  # fmt: skip
        out["frontend"]["cores"] = min(int(f["cores"]) for f in fronts)
    schedulers = [c for c in map(_scheduler_cores, good) if c is not None]
    if schedulers:  # rule 6
        out["scheduler_cores"] = statistics.median(schedulers)
    out["probes"] = len(good)
    out["pull_lines"] = len(lines)
    return out


def calibrate(probe: Mapping[str, Any], base: GpuModel, *, name: str = "calibrated"
              ) -> Calibration:  # fmt: skip
    """Rules 1-6 (module docstring) on one probe of ``kvpeer bench trace --json``."""
    return Calibration(probe, base, name=name)
