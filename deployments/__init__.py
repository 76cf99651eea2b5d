"""Serving and rollout of models: the MLflow registry, the Ray Serve app and router, the canary policy."""
