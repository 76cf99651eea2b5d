"""Where shardline runs and where its bytes live: state dir, storage, Ray cluster, MLflow tracking."""
