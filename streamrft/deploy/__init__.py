"""Deploying a run on a cluster: manifests rendered from the run config (``streamrft k8s``)."""
