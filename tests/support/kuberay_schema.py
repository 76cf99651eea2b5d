"""Validate a KubeRay manifest's `spec` against the vendored CRD (tests/fixtures/kuberay) with jsonschema.

A CRD's openAPIV3Schema is OpenAPI 3.0 with Kubernetes extensions; turned into JSON Schema here as the API server
reads it with strict field validation (`kubectl apply --validate=strict`):
- an object that lists `properties` and neither `additionalProperties` nor `x-kubernetes-preserve-unknown-fields`
  admits no other keys (the API server would reject or silently prune them: a typo would vanish);
- `x-kubernetes-preserve-unknown-fields: true` keeps any keys;
- `x-kubernetes-int-or-string: true` admits an integer or a string (controller-gen also writes the anyOf);
- `nullable: true` admits null.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

CRD_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "kuberay"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}


def to_json_schema(node: Any) -> Any:
    """The JSON Schema of one OpenAPI v3 (Kubernetes structural) schema node."""
    if not isinstance(node, dict):
        return node
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    for key in ("properties", "patternProperties"):
        if key in out:
            out[key] = {name: to_json_schema(sub) for name, sub in out[key].items()}
    for key in ("items", "not"):
        if isinstance(out.get(key), dict):
            out[key] = to_json_schema(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(out["additionalProperties"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [to_json_schema(sub) for sub in out[key]]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
    elif "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


@cache
def spec_schema(kind: str, version: str = "v1") -> dict[str, Any]:
    """The JSON Schema of `kind`'s spec in the vendored CRD."""
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return to_json_schema(served["schema"]["openAPIV3Schema"]["properties"]["spec"])


def spec_errors(manifest: dict[str, Any]) -> list[str]:
    """Every violation of the manifest's spec against its CRD, as 'path: message' (empty: valid)."""
    import jsonschema

    api_group, version = manifest["apiVersion"].split("/")
    assert api_group == "ray.io", manifest["apiVersion"]
    validator = jsonschema.Draft7Validator(spec_schema(manifest["kind"], version))
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<spec>'}: {e.message}"
        for e in sorted(validator.iter_errors(manifest["spec"]), key=lambda e: list(map(str, e.path)))
    ]
