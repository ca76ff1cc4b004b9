"""trace_probe.probe on two tier-less engines with no router: is the pair slowdown the method's?"""
import json, sys, tempfile
from pathlib import Path
from kvpeer.lab.bench import trace_probe
from kvpeer.lab.demo_run import default_model_dir
from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama
from kvpeer.lab.engines.serving import ServeFleet, ServeSpec

tier = sys.argv[1]
model = ensure_llama(Path(default_model_dir(None)), SERVE_LLAMA_CONFIG)
a, b = ServeSpec("a", model, tier=tier, cpu_bytes=800 << 20), ServeSpec("b", model, tier=tier, cpu_bytes=800 << 20)
class Arm:
    def __init__(self, fleet):
        self.engine_urls = [a.url, b.url]
        self.engine_groups = [e.process.pid for e in fleet.engines.values()]
        self.urls = {"shared": a.url}
    def wait_indexed(self, held, timeout_s):
        pass
out = []
with ServeFleet(Path(tempfile.mkdtemp()), lambda m: print(m, file=sys.stderr)) as fleet:
    fleet.start([a, b])
    arm = Arm(fleet)
    if len(sys.argv) > 3 and sys.argv[3] == "warm":
        import random
        from kvpeer.lab.bench.serve_workloads import VOCAB, BenchRequest
        rng = random.Random(1)
        for url in (a.url, b.url):
            for _ in range(2):
                trace_probe._send([BenchRequest(0.0, tuple(rng.randrange(*VOCAB) for _ in range(2016)), 1)], url)
        print("warmed both engines with two 2016-token prompts each", file=sys.stderr)
    for n in range(int(sys.argv[2])):
        p = trace_probe.probe(arm, pulls=False)
        ratio = p["pair_prefill_ttft_s"]["2016"] / p["prefill_ttft_s"]["2016"]
        print(f"probe {n}: alone {p['prefill_ttft_s']['2016']:.3f} pair {p['pair_prefill_ttft_s']['2016']:.3f} ratio {ratio:.2f}", file=sys.stderr)
        out.append(p)
print(json.dumps(out))
