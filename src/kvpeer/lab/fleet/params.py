"""What the fleet model's engines and links cost: Llama-3.1-8B on H100 SXM, three links.

Every figure is either arithmetic from the model's shape and the hardware's datasheet or
an assumption, and says which (docs/fleet.md lists them with their sources). A step of
a vLLM engine is modelled as ``overhead + max(compute, memory)``: compute is the step's
matmul FLOPs (2 x parameters per token) plus attention FLOPs (4 x layers x hidden per
token per context position) at ``mfu`` of peak; memory is reading the weights once and
each decoding sequence's KV cache, at ``hbm_efficiency`` of peak bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["LINKS", "GpuModel", "LinkModel"]


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
}
