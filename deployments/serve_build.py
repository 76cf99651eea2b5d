"""A model's Serve application as code: what `endpoint` deploys, built from an AppSpec.

`build_app` turns an AppSpec (versions served, the router's config) into one ModelServer deployment per version, the
Evidence deployment and the Router; each deployment keeps one fixed Serve code version (`_pinned`), which changes
only with the replicas' code or their deploy-time settings (`settings_version`), so redeploying keeps replicas.
`router_config` is the champion-only router config the control side starts from. Building needs no running Ray.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from pydantic import BaseModel

from deployments.code_files import code_hash
from deployments.config import ServeConfig
from deployments.gateway_control import MODEL_APP_PREFIX, gateway_name, serve_safe
from deployments.router_config import ROUTER, RouterConfig

# the modules whose classes run in a model application's replicas (deployments/code_files.py follows their imports)
REPLICA_ROOTS = ("deployments/serve_app.py", "deployments/model_server.py", "deployments/evidence.py")


class AppSpec(BaseModel):
    """What one application should look like: the versions with a deployment and the router's config."""

    app_name: str
    tracking_uri: str
    versions: list[str]  # every version with a deployment (champion first)
    router: RouterConfig


def app_name_for(serve: ServeConfig, model_name: str) -> str:
    """`serve.app_name`, or 'shardline-<model name>', with a hash of the name where characters Serve dislikes were
    replaced (gateway_control.serve_safe): 'team.gpt' and 'team-gpt' are two models, with two applications."""
    return serve.app_name or MODEL_APP_PREFIX + serve_safe(model_name)


def code_version(tracking_uri: str, serve: ServeConfig) -> str:
    """Serve `version` of the deployments: changes when the replicas' code or their fixed settings change."""
    return hashlib.sha256(f"{settings_version(serve)}:{tracking_uri}".encode()).hexdigest()[:12]


def settings_version(serve: ServeConfig) -> str:
    """The replicas' code and the serve settings fixed at deploy time (replicas, autoscaling, CPUs), hashed: part of
    the router's config, so that reconcile redeploys an application whose settings changed."""
    h = hashlib.sha256(code_hash(REPLICA_ROOTS).encode())
    h.update(
        serve.model_dump_json(
            include={
                "replica_cpus",
                "router_cpus",
                "model_replicas",
                "model_threads",
                "drain_timeout_s",
                "router_replicas",
                "autoscaling",
                "router_autoscaling",
            }
        ).encode()
    )
    return h.hexdigest()[:12]


def router_config(
    serve: ServeConfig, model_name: str, champion: str, token_sha256: str = "", **changes: Any
) -> RouterConfig:
    """The router config serving `champion` alone at 100%, with `changes` applied (challenger, weight, lease)."""
    base = RouterConfig(
        model_name=model_name,
        champion=champion,
        max_request_bytes=serve.max_request_bytes,
        body_timeout_s=serve.body_timeout_s,
        max_prompt_bytes=serve.max_prompt_bytes,
        max_tokens_cap=serve.max_tokens_cap,
        chat_template=serve.chat_template,
        token_sha256=token_sha256,
        gateway=gateway_name(serve),
        settings=settings_version(serve),
    )
    return base.model_copy(update=changes)


def build_app(spec: AppSpec, serve: ServeConfig, runtime_env: dict[str, Any] | None = None) -> Any:
    """The Serve application of a spec: one ModelServer deployment `v<version>` per version, one router."""
    from ray import serve as rs

    from deployments.evidence import Evidence
    from deployments.model_server import ModelServer
    from deployments.serve_app import Router

    version = code_version(spec.tracking_uri, serve)
    # An explicit runtime env, never the deploying job's: Serve would copy that job's environment (which differs
    # from run to run) into the replicas' options, and a changed option restarts every replica of the application.
    env = dict(runtime_env or {})
    env["env_vars"] = {**env.get("env_vars", {}), **_tracking_env(spec.app_name)}
    options: dict[str, Any] = {"num_cpus": serve.replica_cpus, "runtime_env": env}
    server: Any = rs.deployment(ModelServer)  # a Deployment (Ray's overloads type the decorator form)
    scaling = serve.autoscaling.serve_options() if serve.autoscaling else {"num_replicas": serve.model_replicas}
    models = {
        v: _pinned(
            server.options(
                name=f"v{v}",
                ray_actor_options=options,
                **scaling,
                graceful_shutdown_timeout_s=serve.drain_timeout_s,
                graceful_shutdown_wait_loop_s=0.5,
                health_check_period_s=5.0,
                max_ongoing_requests=24,  # the engine batches in-flight completions and serve.batch scores (16)
            ),
            f"{version}-v{v}",
        ).bind(spec.router.model_name, v, spec.tracking_uri, serve.model_threads)
        for v in spec.versions
    }
    evidence_deployment: Any = rs.deployment(Evidence)
    evidence = _pinned(
        evidence_deployment.options(
            name="evidence",
            num_replicas=1,
            ray_actor_options={**options, "num_cpus": serve.router_cpus},
            max_ongoing_requests=256,
        ),
        version,
    ).bind()
    router_scaling = (
        serve.router_autoscaling.serve_options()
        if serve.router_autoscaling
        else {"num_replicas": serve.router_replicas}
    )
    router_deployment: Any = rs.deployment(Router)
    router = _pinned(
        router_deployment.options(
            name=ROUTER,
            ray_actor_options={**options, "num_cpus": serve.router_cpus},
            user_config=spec.router.model_dump(),
            max_ongoing_requests=64,
            **router_scaling,
        ),
        version,
    )
    return router.bind(spec.app_name, models, spec.router.model_name, evidence)


def _tracking_env(app_name: str) -> dict[str, str]:
    """What replicas need to load models from MLflow: plain MLFLOW_TRACKING_* settings, and the path of a 0600 file
    holding the secret ones (Ray logs runtime envs in clear). The file's path is fixed per application, so the
    replicas' options, and with them their Serve version, stay the same from run to run."""
    from infra.credentials import NO_SECRETS, WORKER_SECRETS_ENV, split_secrets, write_secrets_file

    plain, secret = split_secrets({k: v for k, v in os.environ.items() if k.startswith("MLFLOW_TRACKING_")})
    # always set: Ray merges env vars with those of the job that started Serve's controller, whose run's own
    # secrets file is long gone
    plain[WORKER_SECRETS_ENV] = write_secrets_file(f"serve-{app_name}.json", secret) if secret else NO_SECRETS
    return plain


def _pinned(deployment: Any, version: str) -> Any:
    """The deployment with a fixed Serve code version, so that redeploying the application keeps its replicas.

    `serve.run` gives every deployment without a version a random one, which restarts all of an application's
    replicas on each call (a weight change would restart the champion). Ray 2.60 removed the `version` option
    from `Deployment.options()` but still honours the attribute it set; the declarative alternative
    (`serve deploy` configs) would replace every other declaratively deployed application on the cluster.
    tests/integration/test_endpoint.py checks that replicas survive weight changes and added versions.
    """
    deployment._version = version
    return deployment
