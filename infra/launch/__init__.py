"""Cluster launchers: Ray cluster-launcher configs (AWS, Azure) and KubeRay manifests rendered from the config."""
