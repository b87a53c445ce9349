"""The ``ray`` check: start a private Ray (``ray.address: local``) or join the configured cluster in a child
process that is killed at the deadline, and compare what it has with what ``resources`` asks for."""

from __future__ import annotations

import json
import os
import sys

from rlcore.config import Config
from rlcore.controller.address import REACH_TIMEOUT_S, host_port, unreachable
from rlcore.diagnose.base import Check, Context, register, run_bounded

# the line the Ray child process prints its answer on
PROBE_MARK = "RLCORE_RAY_PROBE "


def ray_probe(address: str, num_cpus: int) -> None:
    """Run in a child process by :func:`check_ray`: start a private Ray (``local``) or join
    ``address``, print what it has as one JSON line after :data:`PROBE_MARK`, shut down."""
    import ray

    try:
        if address == "local":
            from rlcore.controller.resource_pool import init_local

            init_local(num_cpus, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        res = ray.cluster_resources()
        try:
            nodes: int | None = sum(1 for n in ray.nodes() if n.get("Alive"))
        except Exception:  # a Ray client (ray://) connection may not list nodes; the resources suffice
            nodes = None
        out = {"cpus": res.get("CPU", 0.0), "gpus": res.get("GPU", 0.0), "nodes": nodes, "version": ray.__version__}
    except Exception as err:
        out = {"error": f"{type(err).__name__}: {' '.join(str(err).split())}"}
    print(PROBE_MARK + json.dumps(out), flush=True)
    ray.shutdown()


def resource_shortfall(cpus: float, gpus: float, cfg: Config) -> str | None:
    """What ``cpus``/``gpus`` lack for one resource pool of ``resources`` (None: enough)."""
    r = cfg.resources
    need_cpu = r.n_workers * r.cpus_per_worker
    lacks = []
    if cpus < need_cpu:
        lacks.append(f"{need_cpu:g} CPUs (resources.n_workers {r.n_workers} x cpus_per_worker "
                     f"{r.cpus_per_worker:g}), has {cpus:g}")
    if r.use_gpu and gpus < r.n_workers:
        lacks.append(f"{r.n_workers} GPUs (one per rank, resources.use_gpu), has {gpus:g}")
    return "; ".join(lacks) or None


@register("ray", background=True)
def check_ray(ctx: Context) -> Check:
    address, num_cpus = ctx.cfg.ray.address, ctx.cfg.ray.num_cpus
    local = address == "local"
    if why := unreachable(address, min(REACH_TIMEOUT_S, ctx.timeout_s)):
        port = host_port(address)[1]  # type: ignore[index]  # parsed, or nothing would be unreachable
        return Check("ray", "fail", f"ray.address {address}: {why}",
                     f"start the head node there (ray start --head --port {port}), or set ray.address: "
                     "local for a private Ray on this machine")
    code = f"from rlcore.diagnose.ray_check import ray_probe; ray_probe({address!r}, {num_cpus})"
    rc, out, stderr = run_bounded([sys.executable, "-c", code], ctx.timeout_s, cwd=ctx.root)
    where = "local (private)" if local else f"ray.address {address}"
    if rc is None:
        fix = ("rerun with a longer --timeout (Ray starts slowly on a busy machine); python -c 'import ray; "
               "ray.init()' shows what it waits on" if local else
               "check the cluster (ray status on the head node) and that it runs this Ray version")
        return Check("ray", "fail", f"{where}: Ray did not answer within {ctx.timeout_s:g}s", fix)
    lines = [ln for ln in out.splitlines() if ln.startswith(PROBE_MARK)]
    if not lines:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        return Check("ray", "fail", f"{where}: the Ray probe exited with code {rc}: {last}",
                     "run python -c 'import ray; ray.init()' to see the full error")
    answer = json.loads(lines[-1][len(PROBE_MARK):])
    if "error" in answer:
        fix = ("start a cluster (ray start --head) or set ray.address: local" if address == "auto" else
               "check the address and that the cluster runs the same Ray version (ray status)")
        if local:
            fix = "run python -c 'import ray; ray.init()' to see the full error"
        if "InvalidAuthToken" in stderr:  # Ray >= 2.52 token authentication: the head wants a token
            return Check("ray", "fail", f"{where}: the cluster refused this process's Ray auth token",
                         "export RAY_AUTH_MODE=token, with the head node's token in ~/.ray/auth_token or "
                         "RAY_AUTH_TOKEN (ray get-auth-token on the head prints it)")
        return Check("ray", "fail", f"{where}: {answer['error']}", fix)
    cpus, gpus = float(answer["cpus"]), float(answer["gpus"])
    r = ctx.cfg.resources
    needs = f"{r.n_workers * r.cpus_per_worker:g} CPUs" + (f", {r.n_workers} GPUs" if r.use_gpu else "")
    nodes = "" if answer["nodes"] is None else f"{answer['nodes']} node(s), "
    found = (f"{where}, Ray {answer['version']}: {nodes}{cpus:g} CPUs, {gpus:g} GPUs "
             f"(the pipeline needs {needs})")
    short = resource_shortfall(cpus, gpus, ctx.cfg)
    if short:
        fix = ("lower resources.n_workers or cpus_per_worker" +
               (", or raise ray.num_cpus" if local and "CPUs" in short else "") +
               (", or set resources.use_gpu: false" if "GPUs" in short else "") +
               ("" if local else ", or add nodes to the cluster"))
        return Check("ray", "fail", f"{where}, Ray {answer['version']}: {nodes}needs {short}", fix)
    cores = os.cpu_count() or 1
    if local and num_cpus > cores:
        return Check("ray", "warn", f"{found}; ray.num_cpus {num_cpus} > {cores} cores here: ranks share cores",
                     f"set ray.num_cpus: {cores} unless the oversubscription is meant")
    return Check("ray", "ok", found)
