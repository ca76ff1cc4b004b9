"""The fleet model of the two CPU engines with a preset calibrated from the given bench
trace --probe results (kvpeer lab fleet --calibrate's rules), beside measured windows:
as `kvpeer lab fleet --engine cpu-pair --measured`, the preset swapped for this one."""
import json, sys
from kvpeer.lab.fleet import params
from kvpeer.lab.fleet.calibrate import calibrate, pooled_probe
from kvpeer.cli import main

probe_files, measured = sys.argv[1].split(","), sys.argv[2:]
probes = {}
for path in probe_files:
    for arm, probe in json.load(open(path))["probes"].items():
        probes[f"{path}:{arm}"] = probe
calibration = calibrate(pooled_probe(probes), params.CPU_PAIR_SHAPE)
print(json.dumps(calibration.figures() if hasattr(calibration, "figures") else calibration.fit), file=sys.stderr)
params.ENGINES["cpu-pair"] = calibration.gpu
if calibration.link is not None:
    params.LINKS["shm"] = calibration.link
for path in measured:
    print(f"== measured: {path}")
    main(["lab", "fleet", "--trace", "/tmp/traces/conversation_trace.jsonl", "--engines", "2",
          "--engine", "cpu-pair", "--link", "shm", "--policy", "affinity,kvpeer", "--window", "4",
          "--time-scale", "4", "--block-tokens", "32", "--context", "2048", "--measured", path])
