"""Helpers the tests share: corpora and configs, real storage servers (moto, Azurite), PostgreSQL, load generators,
Serve and training set-ups, the stack's CLI driver. Not tests themselves; `pythonpath = ["tests"]` (pyproject.toml)
makes them importable as `support.*` from every tier, and Ray workers get the same folder on their PYTHONPATH."""
