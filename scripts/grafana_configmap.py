"""Write deploy/k8s/grafana-dashboard.yaml from docs/grafana/kvpeer.json.

Run from the repository root after editing the dashboard; tests/test_deploy.py fails
while the ConfigMap and the JSON differ.
"""

from __future__ import annotations

from pathlib import Path

HEAD = """\
# The Grafana dashboard (docs/grafana/kvpeer.json) for Grafana's dashboard sidecar, which
# loads ConfigMaps labelled grafana_dashboard=1. Written by scripts/grafana_configmap.py:
# edit the JSON and run it again.
apiVersion: v1
kind: ConfigMap
metadata:
  name: kvpeer-grafana-dashboard
  labels:
    app.kubernetes.io/name: kvpeer
    app.kubernetes.io/component: monitoring
    grafana_dashboard: "1"
data:
  kvpeer.json: |
"""


def render(dashboard: str) -> str:
    """The ConfigMap embedding ``dashboard`` verbatim as a literal block."""
    if not dashboard.endswith("\n") or dashboard.endswith("\n\n"):
        raise ValueError("the dashboard must end with exactly one newline (a YAML | block)")
    lines = dashboard.splitlines()
    if any(line != line.rstrip() or line.startswith("\t") for line in lines):
        raise ValueError("the dashboard has trailing blanks or tabs, which YAML would alter")
    return HEAD + "".join(f"    {line}\n" if line else "\n" for line in lines)


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    dashboard = (root / "docs/grafana/kvpeer.json").read_text(encoding="utf-8")
    (root / "deploy/k8s/grafana-dashboard.yaml").write_text(render(dashboard), encoding="utf-8")


if __name__ == "__main__":
    main()
