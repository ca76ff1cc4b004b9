import json, sys
from functools import partial
from pathlib import Path
import kvpeer.lab.bench.corun as corun
import kvpeer.lab.engines.serving as serving
from kvpeer.lab.demo_run import default_model_dir
tier = sys.argv[1]
orig = serving.ServeSpec
def spec(name, model, tier_=None, **kw):
    return orig(name, model, tier=tier, cpu_bytes=800 << 20)
serving.ServeSpec = lambda name, model, tier="none": spec(name, model)
corun._kernels = lambda s, p: {"bandwidth": [], "compute": []}
r = corun.run(corun.CorunSpec(turns=6), Path(default_model_dir(None)), lambda m: print(m, file=sys.stderr))
print(json.dumps(r))
