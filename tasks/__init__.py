"""Prefect tasks, one per stage: retries, backoff, MLflow lineage and artifacts around the plain stage logic."""
