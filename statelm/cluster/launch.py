"""`statelm serve --replicas N`: start (or join) Ray, deploy N engine replicas as Ray Serve applications, and serve
the router on --host/--port until a signal; then every replica saves its sessions to the shared state dir."""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

import statelm
from statelm.cluster.balancer import Balancer, Policy
from statelm.cluster.ledger import KeyLedger
from statelm.cluster.metrics import RouterMetrics
from statelm.cluster.placement import Placement
from statelm.cluster.replica import APP_PREFIX, EngineReplica
from statelm.cluster.router import RouterApp
from statelm.cluster.scaling import Scaler
from statelm.cluster.store import StoredSessions
from statelm.config import ClusterConfig, EngineConfig, ServerConfig
from statelm.server.drain import DrainGate, DrainMiddleware
from statelm.server.launch import LaunchError, bind_listener, configure_logging, key_ring, serve_http
from statelm.sessions.directory_store import DirectoryStore

log = logging.getLogger("statelm")
CONTROL_CALLS = 64  # room for the router's own calls (ping, holds, adopt) beside requests
# Ray Serve finds a dead replica by its periodic health check and only then starts another: every 2 s, not its 10, a
# killed replica is back in seconds (a check is one small actor call)
HEALTH_CHECK_PERIOD_S = 2.0
# a replica being stopped polls for requests still in flight in steps of this, not Ray's 2 s: a drained one (no
# requests left) goes at once
SHUTDOWN_WAIT_STEP_S = 0.2


def replica_name(index: int) -> str:
    """The name of the replica with that index: replica-0, replica-1, …"""
    return f"replica-{index}"


def start_ray(cluster: ClusterConfig) -> None:
    """Join the Ray cluster at --ray-address, or start a local instance sized for the replicas; workers import this
    statelm (a local instance's workers get its directory on their path)."""
    if cluster.ray_address is not None:
        ray.init(address=cluster.ray_address, log_to_driver=True)
        return
    # Ray runs its workers at nice 15 to favour its own daemons; here the workers are the engines that answer
    # requests, and niced they lose the CPU to the router whenever both want it (a choice set by hand is kept)
    os.environ.setdefault("RAY_worker_niceness", "0")
    source = str(Path(statelm.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=max(math.ceil(cluster.replicas * cluster.replica_cpus), os.cpu_count() or 1),  # room to scale up
        num_gpus=math.ceil(cluster.replicas * cluster.replica_gpus),
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )


class ReplicaDeployer:
    """Deploys engine replicas, each its own Ray Serve application of one replica (so that the router can address
    each), counting every key's sessions and responses in the ledger; and deletes them."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig, ledger: Any):
        self.engine_config = engine_config
        self.server_config = replace(server_config, resume_sessions=False)  # sessions come by adoption
        self.ledger = ledger
        self.cluster = cluster
        self.deployment = serve.deployment(
            EngineReplica,
            num_replicas=1,
            max_ongoing_requests=engine_config.max_num_seqs + engine_config.max_queue + CONTROL_CALLS,
            graceful_shutdown_timeout_s=server_config.drain_timeout + 120,  # requests finish, then sessions are saved
            graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_STEP_S,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            ray_actor_options={"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus},
            logging_config={"enable_access_log": False},  # the replica's own app logs what it answers
        )

    def deploy(self, names: list[str], wait: bool = True) -> dict[str, DeploymentHandle]:
        """Start replicas with those names together; with wait, returns once every one serves (blocks)."""
        targets = [
            serve.RunTarget(
                self.deployment.options(name=name).bind(name, self.engine_config, self.server_config, self.ledger),
                APP_PREFIX + name,
                None,
            )
            for name in names
        ]
        handles = serve.run_many(targets, wait_for_ingress_deployment_creation=wait, wait_for_applications_running=wait)
        return dict(zip(names, handles, strict=True))

    def delete(self, name: str, wait: bool) -> None:
        """Have Ray Serve remove a replica's application (after its drain); with wait, until it is gone and its
        resources are free (not for a replica Ray never placed, which can take Ray Serve minutes to give up)."""
        serve.delete(APP_PREFIX + name, _blocking=wait)

    def room(self) -> int:
        """How many more replicas the Ray instance's free CPUs and GPUs can hold now."""
        free = ray.available_resources()
        fits = [
            math.floor(free.get(resource, 0.0) / need + 1e-9)
            for resource, need in (("CPU", self.cluster.replica_cpus), ("GPU", self.cluster.replica_gpus))
            if need > 0
        ]
        return min(fits, default=sys.maxsize)


def run_cluster(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig) -> None:
    """Serve N replicas behind the router until a signal, then drain the router and stop every replica."""
    configure_logging(server_config.log_level)
    keys = key_ring(server_config)
    try:
        policy = Policy(cluster.routing)
    except ValueError:
        raise LaunchError(f"unknown routing {cluster.routing!r}: use {', '.join(Policy)}") from None
    listener = bind_listener(server_config)  # before Ray, whose processes bind ports of their choosing
    start_ray(cluster)
    try:
        serve.start(http_options={"location": "NoServer"})  # the router below is the only HTTP endpoint
        restarted = {"max_restarts": -1, "max_task_retries": -1}  # Ray restarts the ledger; calls wait it out
        ledger_actor = ray.remote(num_cpus=0, **restarted)(KeyLedger)
        ledger = ledger_actor.remote()
        deployer = ReplicaDeployer(engine_config, server_config, cluster, ledger)
        handles = deployer.deploy([replica_name(index) for index in range(cluster.replicas)])
        log.info("%d replicas serving; routing %s", len(handles), policy)
        store = StoredSessions(DirectoryStore(server_config.state_dir))
        placement = Placement(handles, store, Balancer(policy), RouterMetrics(), ledger)
        room = deployer.room if cluster.ray_address is None else None  # a joined cluster may autoscale
        scaler = Scaler(placement, partial(deployer.deploy, wait=False), deployer.delete, replica_name, room)
        router = RouterApp(
            placement, scaler, keys, not server_config.metrics_require_key, server_config.max_request_bytes
        )
        gate = DrainGate(server_config.drain_timeout)
        app = DrainMiddleware(router, gate, exempt_paths=frozenset({"/health"}))
        serve_http(app, server_config, gate, listener)
    finally:
        serve.shutdown()  # every replica's graceful shutdown saves its sessions
        if cluster.ray_address is None:
            ray.shutdown()
