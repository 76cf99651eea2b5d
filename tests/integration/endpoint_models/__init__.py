"""Several models on one stack: one gateway, the request's `model` picks the model, each model's canary its own.

Two byte-level models are registered in one registry and served behind one route prefix. The package's tests share
one `world` (conftest.py): a local Ray of their own, Serve on a free port and that registry, started once for the
package and shut down when its last test ends, before any other test runs. Each file is one concern:

- test_routing.py: requests routed by model, the gateway's own settings, an address shardline cannot host;
- test_served_forms.py: a model export cannot capture served eagerly, a version's own chat template;
- test_canaries.py: two models' canaries at once, a canary behind two autoscaled router replicas;
- test_overload.py: fast 503s over the queue, a trickled body timed out.

Every test deploys what it needs itself, so any file or test also runs alone.
"""

MODELS = ("alpha-bytes", "beta-bytes")
