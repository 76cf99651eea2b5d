"""The local service stack (`shardline up/down/status`): PostgreSQL databases, Prefect server, MLflow server,
work pool and worker, Ray head and model endpoint, each a small module with start/stop/status."""
