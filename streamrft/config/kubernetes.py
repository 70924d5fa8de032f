"""``kubernetes``: how ``streamrft k8s`` lays a run out on a cluster (Strimzi for Kafka, KEDA for autoscaling,
the Prometheus operator for scraping). Only the renderer reads it; the roles never do."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class KubernetesConfig(Section):
    namespace: str = Field(default="streamrft", pattern=_DNS_LABEL, description="the namespace of the run's "
                                                                              "manifests")
    image: str = Field(default="streamrft:latest", min_length=1, description="the image of compose/Dockerfile")
    kafka_cluster: str = Field(default="streamrft", pattern=_DNS_LABEL,
                               description="name of the Strimzi Kafka resource the run's topics belong to")
    kafka_listener_port: int = Field(default=9092, ge=1, le=65535,
                                     description="the Strimzi listener the roles connect to "
                                                 "(<kafka_cluster>-kafka-bootstrap:<port>)")
    shared_volume_claim: str = Field(default="streamrft-shared", pattern=_DNS_LABEL,
                                     description="a ReadWriteMany claim mounted at /shared in every role (model "
                                                 "cache, checkpoints, weights when they go through a file URL)")
    secret: str | None = Field(default=None, pattern=r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$",
                               description="prefix of the roles' own Secrets: role R reads its secret keys "
                                           "(STREAMRFT_<SECTION>__<KEY>, e.g. STREAMRFT_TRAINER__WEIGHTS__S3__"
                                           "SECRET_ACCESS_KEY) from the Secret <secret>-R only; none = "
                                           "<name>-R-secrets. Never written into the manifests")
    checkpoint_volume_claim: str = Field(default="streamrft-checkpoints", pattern=_DNS_LABEL,
                                         description="a claim of the trainer's own, mounted at /checkpoints: "
                                                     "trainer.checkpoint_dir must be under it")
    monitoring_namespace: str = Field(default="monitoring", pattern=_DNS_LABEL,
                                      description="the namespace Prometheus scrapes from: the NetworkPolicy "
                                                  "lets it reach the roles' metrics port, nothing else")
    run_as_user: int = Field(default=1000, ge=1, le=2**31 - 1,
                             description="uid (and gid) every container runs as: the image's non-root user")
    trainer_gpus: int = Field(default=1, ge=0, description="GPUs of the trainer pod (nvidia.com/gpu), a rank "
                                                           "on each: equal to trainer.nproc unless 0 (CPU)")
    rollout_gpus: int = Field(default=1, ge=0, description="GPUs of each rollout worker pod (nvidia.com/gpu)")
    rollout_min_replicas: int = Field(default=1, ge=0, description="the fewest rollout workers KEDA scales to; 0 = "
                                                                   "none while rollouts has no lag")
    rollout_max_replicas: int | None = Field(
        default=None, ge=1, description="default and upper bound: the rollouts topic's partitions (a member "
                                        "beyond them would get no partition; KEDA caps it there too)")
    rollout_lag_threshold: int = Field(default=4, ge=1,
                                       description="KEDA adds a worker per this many requests of lag on rollouts")
    kafka_authentication: Literal["none", "scram-sha-512"] = Field(
        default="none", description="scram-sha-512: a Strimzi KafkaUser per role with the ACLs of `streamrft acls`; "
                                    "each role connects as its own user (password from the user's Secret)")
    kafka_tls: bool = Field(default=False, description="the listener is TLS: the roles trust the Strimzi cluster CA")
