"""Record a real vLLM 0.32 KV event stream for the router's tests.

Usage (about a minute on one core)::

    PYTHONPATH=src python tests/router/data/record_vllm_stream.py tests/router/data/OUT

One in-process engine (tiny Llama, block size 32, the OffloadingConnector on kvpeer's
CPU spec with ``self_describing_kv_events``) publishes its KV events on a loopback
port; a SUB socket records every ``[topic, seq, payload]``. The engine serves prompt A,
then A extended by two blocks, then resets its prefix cache, then serves B. The output
is a msgpack list of ``[seq, payload]`` plus the prompts, which the test replays.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq

BLOCK = 32
PROMPT_A = [(11 * i + 5) % 500 for i in range(4 * BLOCK + 7)]
PROMPT_A2 = [*PROMPT_A[: 4 * BLOCK], *[(13 * i + 1) % 500 for i in range(2 * BLOCK + 9)]]
PROMPT_B = [(17 * i + 3) % 500 for i in range(3 * BLOCK + 1)]


def main(out: Path) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    from vllm import LLM, SamplingParams, TokensPrompt

    from kvpeer.lab.engines.model import ensure_tiny_llama

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    frames: list[list[Any]] = []
    done = threading.Event()

    def collect() -> None:
        while not done.is_set():
            if sub.poll(100):
                _topic, seq, payload = sub.recv_multipart()
                frames.append([int.from_bytes(seq, "big"), payload])

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_tiny_llama(Path(tmp) / "tiny-llama")
        engine_id = f"router-record-{os.getpid()}"
        llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            seed=0,
            block_size=BLOCK,
            enable_prefix_caching=True,
            max_num_seqs=4,
            # The publisher connects to our bound SUB (no wildcard: vLLM connects).
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{port}",
            },
            kv_transfer_config={
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "engine_id": engine_id,
                "kv_connector_extra_config": {
                    "spec_name": "CpuOffloadingSpec",
                    "spec_module_path": "kvpeer.integrations.vllm.cpu_spec",
                    "cpu_bytes_to_use": 64 << 20,
                    "self_describing_kv_events": True,
                },
            },
        )
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
        for prompt in (PROMPT_A, PROMPT_A2):
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        llm.reset_prefix_cache()
        llm.generate([TokensPrompt(prompt_token_ids=PROMPT_B)], params, use_tqdm=False)
        llm.generate([TokensPrompt(prompt_token_ids=PROMPT_B)], params, use_tqdm=False)
        # Let the publisher thread flush, then stop recording.
        deadline_frames = len(frames)
        sub.poll(2000)
        del llm, deadline_frames
        done.set()
        thread.join()
        for path in Path("/dev/shm").glob(f"vllm_offload_{engine_id}*"):
            path.unlink()
    recording = {
        "vllm": "0.32.0",
        "block_size": BLOCK,
        "prompts": {"A": PROMPT_A, "A2": PROMPT_A2, "B": PROMPT_B},
        "frames": frames,
    }
    out.write_bytes(msgspec.msgpack.encode(recording))
    print(f"recorded {len(frames)} frames to {out}")
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
