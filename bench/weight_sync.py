"""Weight sync for asynchronous PPO: how fast a trainer actor hands a full policy state dict to a
generator actor, through the Ray object store or a torch.distributed (gloo) broadcast.

    .venv/bin/python -m bench.weight_sync                              # tiny,125m,500m (under 2 minutes)
    .venv/bin/python -m bench.weight_sync --sizes tiny,125m,500m,1.5b --reps 5 --json /tmp/ws.json

Two Ray actors (1 CPU each) in a private local Ray instance: a trainer holding the weights and a generator
holding its own copy of the same shapes. One publish is timed from the trainer starting to send (after it
tagged every tensor with the new version) to the generator having the weights in its own tensors; the
generator then checks that every tensor carries that version (not timed). Four ways:

- ``ray pickle``: trainer ``ray.put(state_dict)`` (the dict of torch tensors as it is), hands ``[ref]`` to the
  generator through the driver; generator ``ray.get`` + ``load_state_dict`` (copy into its tensors). Torch
  pickles each tensor's storage to bytes, so it is the slowest way by far: run only up to ``--pickle-max-params``.
- ``ray zero-copy``: the same, but the trainer puts each tensor as a uint8 numpy view of its bytes, so the put
  is one copy into the store and the generator's ``ray.get`` maps the store's memory (no copy) before the
  ``load_state_dict`` copy (what ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`` does).
- ``ray flat``: the trainer copies all tensors into one preallocated buffer per dtype and puts that (as bytes,
  zero-copy); the generator copies its slices into its tensors. Ray's put is much faster for one large buffer
  than for a hundred 2 MB ones.
- ``gloo per-tensor``: both actors in one gloo group (TCP rendezvous on 127.0.0.1); rank 0 broadcasts each
  tensor, the generator receives straight into its own tensors.
- ``gloo flat``: the trainer copies all tensors into one preallocated buffer per dtype and broadcasts it; the
  generator receives into its own preallocated buffer and copies back into its tensors.

Warm-up: one untimed publish for gloo, two for ``ray pickle``; for the other object-store ways, as many as it
takes to send the store's size once (its fresh pages cost more than the copy; a trainer publishing every step
runs on a warm store).

Sizes: ``tiny`` is the built-in model (``rlcore.engine.tiny_model``, params.yaml's shape, float32); the others
are Llama-layout state dicts (embedding, 9 tensors a layer, final norm, lm_head) of about 125M, 500M and 1.5B
parameters in ``--dtype`` (bfloat16 by default). A size whose copies (trainer, object store, generator,
deserialised copy) would not fit in the memory available now is skipped, with the reason. Reported: the median
over ``--reps`` publishes after the warm-up, per way and size, GB/s (bytes of the state dict / median) and
object store / gloo ratio (best way of each).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import psutil
import ray
import torch

from rlcore.controller.resource_pool import init_local

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WAYS = ("ray pickle", "ray zero-copy", "ray flat", "gloo per-tensor", "gloo flat")
# Llama layout: hidden, layers, intermediate, vocab.
SYNTHETIC = {
    "125m": {"hidden": 768, "layers": 12, "intermediate": 1792, "vocab": 32000},
    "500m": {"hidden": 1024, "layers": 24, "intermediate": 4352, "vocab": 32000},
    "1.5b": {"hidden": 1536, "layers": 28, "intermediate": 8960, "vocab": 32000},
}
DEFAULT_SIZES = "tiny,125m,500m"
GIB = 2**30


# ---------------------------------------------------------------- shapes

def llama_shapes(hidden: int, layers: int, intermediate: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Llama-style causal LM's state dict, untied lm_head."""
    h, i = hidden, intermediate
    out = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (h, h)),
                (p + "self_attn.v_proj.weight", (h, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def tiny_folder() -> Path:
    """The built-in tiny model's folder for params.yaml's shape and seed (built once, cached)."""
    import yaml

    from rlcore.engine.model import TINY_CACHE
    from rlcore.engine.tiny_model import materialize_tiny

    shape = {"arch": "llama", "hidden_size": 64, "num_layers": 3, "num_heads": 4, "intermediate_size": 256,
             "max_position_embeddings": 128}
    seed = 0
    try:
        params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
        shape = dict(params["model"]["tiny"])
        seed = int(params.get("seed", seed))
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as e:  # params.yaml missing or moved: the documented default shape
        print(f"weight_sync: params.yaml's model.tiny not read ({e}); using hidden 64, 3 layers", file=sys.stderr)
    return materialize_tiny(TINY_CACHE, seed=seed, **shape)


def size_spec(name: str, dtype: str) -> dict:
    if name == "tiny":
        return {"kind": "tiny", "folder": str(tiny_folder())}
    if name not in SYNTHETIC:
        raise SystemExit(f"weight_sync: unknown size {name!r}; choose from tiny,{','.join(SYNTHETIC)}")
    return {"kind": "synthetic", "shapes": llama_shapes(**SYNTHETIC[name]), "dtype": dtype}


def spec_bytes(spec: dict) -> tuple[int, int]:
    """(parameters, bytes) of a synthetic spec; the tiny one is measured by the actors."""
    numel = sum(_numel(s) for _, s in spec["shapes"])
    return numel, numel * torch.empty((), dtype=DTYPES[spec["dtype"]]).element_size()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- the actors

def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor gloo sends: as it is (gloo broadcasts float32/16, bfloat16, ints but int16, which it rejects
    with "Invalid scalar type": those go as their bytes)."""
    return t.view(torch.uint8) if t.dtype in (torch.int16, torch.uint16) else t


@ray.remote(num_cpus=1)
class Endpoint:
    """One side of the sync: the trainer (rank 0, sends) or the generator (rank 1, receives)."""

    def __init__(self, role: str):
        self.role = role
        self.model = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.staging: dict[torch.dtype, torch.Tensor] = {}
        warnings.filterwarnings("ignore", message=".*not writable.*")  # read-only store views, only read

    def build(self, spec: dict) -> dict:
        """This side's weights: the tiny model itself, or tensors of the synthetic shapes."""
        self.drop()
        torch.set_grad_enabled(False)
        if spec["kind"] == "tiny":
            from transformers.utils import logging as hf_logging

            from rlcore.engine.model import load_causal_lm

            hf_logging.disable_progress_bar()
            self.model = load_causal_lm(spec["folder"]).requires_grad_(False)
            self.tensors = dict(self.model.state_dict())
        else:
            dtype = DTYPES[spec["dtype"]]
            make = (lambda s, k: torch.full(s, 0.01 * (k % 7 + 1), dtype=dtype)) if self.role == "trainer" \
                else (lambda s, k: torch.zeros(s, dtype=dtype))
            self.tensors = {name: make(shape, k) for k, (name, shape) in enumerate(spec["shapes"])}
        return {"numel": sum(t.numel() for t in self.tensors.values()),
                "bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
                "tensors": len(self.tensors),
                "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in self.tensors.values()})}

    def drop(self) -> None:
        self.model, self.tensors, self.staging = None, {}, {}
        gc.collect()

    def rss_gib(self) -> float:
        return psutil.Process().memory_info().rss / GIB

    # -- the version tag every publish carries (first element of every tensor), and its check
    def _mark(self, version: int) -> None:
        for t in self.tensors.values():
            t.view(-1)[0] = version

    def _has(self, version: int) -> bool:
        return all(float(t.view(-1)[0]) == version for t in self.tensors.values())

    def _load(self, sd: dict) -> None:
        if self.model is not None:
            self.model.load_state_dict(sd, strict=True)
        else:
            for name, dst in self.tensors.items():
                dst.copy_(sd[name])

    # -- object store
    def publish(self, version: int, mode: str):
        self._mark(version)
        t0 = time.monotonic()
        if mode == "flat":
            payload = {}
            for dtype, ts in self._groups().items():
                buf = self.staging[dtype]
                torch.cat([t.reshape(-1) for t in ts], out=buf)
                payload[str(dtype)] = buf.view(torch.uint8).numpy()
        elif mode == "zero-copy":
            payload = {k: t.reshape(-1).view(torch.uint8).numpy() for k, t in self.tensors.items()}
        else:
            payload = self.tensors
        ref = ray.put(payload)
        return [ref], t0, time.monotonic()  # a list: the ref travels as a ref, not as its value

    def pull(self, refs: list, mode: str, version: int):
        t_start = time.monotonic()
        payload = ray.get(refs[0])
        t_got = time.monotonic()
        sd = None
        if mode == "flat":
            for dtype, ts in self._groups().items():
                buf = torch.from_numpy(payload[str(dtype)]).view(dtype)
                for t, part in zip(ts, torch.split(buf, [t.numel() for t in ts])):
                    t.view(-1).copy_(part)  # the model's own tensors (state_dict views)
        elif mode == "zero-copy":
            sd = {k: torch.from_numpy(payload[k]).view(t.dtype).view(t.shape) for k, t in self.tensors.items()}
        else:
            sd = payload
        if sd is not None:
            self._load(sd)
        t1 = time.monotonic()
        del sd, payload, refs
        return t_start, t_got, t1, self._has(version)

    # -- gloo
    def join(self, rank: int, port: int) -> None:
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=300))

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _groups(self) -> dict[torch.dtype, list[torch.Tensor]]:
        out: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in self.tensors.values():
            out.setdefault(t.dtype, []).append(t)
        return out

    def make_staging(self) -> None:
        """One flat buffer per dtype (allocated and touched once, as a real sender/receiver keeps it)."""
        if self.staging:
            return
        self.staging = {d: torch.zeros(sum(t.numel() for t in ts), dtype=d) for d, ts in self._groups().items()}

    def gloo_send(self, version: int, flat: bool):
        import torch.distributed as dist

        self._mark(version)
        t0 = time.monotonic()
        if flat:
            for dtype, ts in self._groups().items():
                buf = self.staging[dtype]
                torch.cat([t.reshape(-1) for t in ts], out=buf)
                dist.broadcast(_wire(buf), src=0)
        else:
            for t in self.tensors.values():
                dist.broadcast(_wire(t), src=0)
        return t0, time.monotonic()

    def gloo_recv(self, version: int, flat: bool):
        import torch.distributed as dist

        t_start = time.monotonic()
        if flat:
            for dtype, ts in self._groups().items():
                buf = self.staging[dtype]
                dist.broadcast(_wire(buf), src=0)
                for t, part in zip(ts, torch.split(buf, [t.numel() for t in ts])):
                    t.view(-1).copy_(part)
        else:
            for t in self.tensors.values():
                dist.broadcast(_wire(t), src=0)
        t1 = time.monotonic()
        return t_start, t1, self._has(version)


# ---------------------------------------------------------------- the driver

class Bench:
    def __init__(self, reps: int, store_bytes: int):
        self.reps = reps
        self.store_bytes = store_bytes
        self.version = 0
        self.trainer = Endpoint.remote("trainer")
        self.generator = Endpoint.remote("generator")
        self.joined = False

    def next_version(self) -> int:
        self.version = self.version % 200 + 1  # exact in bfloat16
        return self.version

    def join(self) -> None:
        from rlcore.engine.distributed import free_port

        port = free_port()
        ray.get([self.trainer.join.remote(0, port), self.generator.join.remote(1, port)], timeout=300)
        self.joined = True

    def one(self, way: str) -> dict:
        v = self.next_version()
        if way.startswith("ray"):
            mode = way.split()[1]
            refs, t0, t_put = ray.get(self.trainer.publish.remote(v, mode))
            t_start, t_got, t1, ok = ray.get(self.generator.pull.remote(refs, mode, v))
            del refs
            parts = {"put": t_put - t0, "handoff": t_start - t_put, "get": t_got - t_start, "load": t1 - t_got}
        else:
            flat = way == "gloo flat"
            recv = self.generator.gloo_recv.remote(v, flat)  # the generator waits in the broadcast first
            time.sleep(0.02)
            (t0, t_sent), (t_start, t1, ok) = ray.get([self.trainer.gloo_send.remote(v, flat), recv])
            parts = {"send": t_sent - t0, "receiver_late": max(0.0, t_start - t0)}
        if not ok:
            raise RuntimeError(f"{way}: the generator does not have version {v} in every tensor")
        return {"s": t1 - t0, **parts}

    def warmups(self, way: str, nbytes: int) -> int:
        """Untimed publishes first. The store hands each put memory its pages may never have had (first touch
        costs more than the copy: a 974 MB put took 0.5-3 s the first times, 120-140 ms after); a trainer that
        publishes every step runs on a warm store, so the object-store ways publish until the store's size went
        through, once (at most 20); ``ray pickle`` two (serialising dominates it). The gloo ways: one
        (connections, the receiver's pages)."""
        if way.startswith("gloo"):
            return 1
        if way == "ray pickle":
            return 2
        return max(1, min(20, -(-self.store_bytes // max(nbytes, 1)) + 1))

    def way(self, way: str, nbytes: int) -> tuple[list[dict], int]:
        if way.startswith("gloo") and not self.joined:
            self.join()
        if way == "ray flat":
            ray.get(self.trainer.make_staging.remote())
        if way == "gloo flat":
            ray.get([self.trainer.make_staging.remote(), self.generator.make_staging.remote()])
        n_warm = self.warmups(way, nbytes)
        for _ in range(n_warm):
            self.one(way)
        return [self.one(way) for _ in range(self.reps)], n_warm

    def close(self) -> None:
        for actor in (self.trainer, self.generator):
            try:
                ray.get(actor.leave.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as e:  # a dead actor has no group left to destroy
                print(f"weight_sync: leaving the gloo group: {e}", file=sys.stderr)
            ray.kill(actor)


def need_bytes(nbytes: int, pickle: bool) -> int:
    """Peak memory of one size: trainer, its flat buffer, two objects in the store (one being freed while the next
    is put), generator; ``ray pickle`` adds a serialised copy on each side. Plus slack."""
    return int((5.5 if pickle else 4.5) * nbytes) + GIB


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 0.1 else f"{s * 1e3:.0f}"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list of tiny,{','.join(SYNTHETIC)}")
    p.add_argument("--reps", type=int, default=5, help="timed publishes per way and size (after untimed warm-up ones)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the synthetic sizes")
    p.add_argument("--ways", default=",".join(WAYS), help="comma list of: " + ", ".join(WAYS))
    p.add_argument("--pickle-max-params", type=float, default=200.0, metavar="M",
                   help="run 'ray pickle' only at sizes of at most M million params (it is the slowest way by "
                        "far, ~10x at 125m, and needs two more copies of the weights)")
    p.add_argument("--json", default=None, metavar="OUT", help="write every sample and the summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if bad := [w for w in ways if w not in WAYS]:
        raise SystemExit(f"weight_sync: unknown way(s) {bad}; choose from {', '.join(WAYS)}")
    if args.reps < 1:
        raise SystemExit("weight_sync: --reps must be >= 1")
    specs = {s: size_spec(s, args.dtype) for s in sizes}

    # Sizes that cannot fit are skipped before anything starts; the store is sized for the largest that can.
    avail = psutil.virtual_memory().available
    skipped: dict[str, str] = {}
    no_pickle: list[str] = []
    fit_bytes = [GIB // 4]
    for s, spec in specs.items():
        if spec["kind"] == "synthetic":
            numel, nb = spec_bytes(spec)
            if "ray pickle" in ways and numel > args.pickle_max_params * 1e6:
                no_pickle.append(s)
            spec["pickle"] = "ray pickle" in ways and s not in no_pickle
            if need_bytes(nb, spec["pickle"]) > avail - GIB:  # Ray itself
                skipped[s] = (f"{nb / GIB:.1f} GiB of weights needs ~{need_bytes(nb, spec['pickle']) / GIB:.0f} "
                              f"GiB at peak, {avail / GIB:.1f} GiB available")
            else:
                fit_bytes.append(nb)
    store = int(min(max(2.5 * max(fit_bytes), GIB), 0.45 * avail))

    os.environ.setdefault("RAY_worker_niceness", "0")  # as rlcore's start_ray: ranks at the driver's priority
    init_local(2, log_to_driver=True, object_store_memory=store)
    results: list[dict] = []
    bench = None
    t_start = time.monotonic()
    try:
        bench = Bench(args.reps, store)
        for s in sizes:
            if s in skipped:
                print(f"weight_sync: skipping {s}: {skipped[s]}", file=sys.stderr, flush=True)
                continue
            spec = specs[s]
            if spec["kind"] == "synthetic":
                _, nb = spec_bytes(spec)
                avail_now = psutil.virtual_memory().available
                if need_bytes(nb, spec["pickle"]) > avail_now:
                    skipped[s] = (f"needs ~{need_bytes(nb, spec['pickle']) / GIB:.0f} GiB at peak, "
                                  f"{avail_now / GIB:.1f} GiB available now")
                    print(f"weight_sync: skipping {s}: {skipped[s]}", file=sys.stderr, flush=True)
                    continue
            info, _ = ray.get([bench.trainer.build.remote(spec), bench.generator.build.remote(spec)])
            print(f"weight_sync: {s}: {info['numel'] / 1e6:.1f}M params, {info['tensors']} tensors, "
                  f"{info['bytes'] / 1e6:.0f} MB {'/'.join(info['dtypes'])}", file=sys.stderr, flush=True)
            for way in ways:
                if way == "ray pickle" and s in no_pickle:
                    continue
                samples, n_warm = bench.way(way, info["bytes"])
                med = statistics.median(x["s"] for x in samples)
                parts = {k: statistics.median(x[k] for x in samples) for k in samples[0] if k != "s"}
                results.append({"size": s, "way": way, **info, "median_s": med, "parts_s": parts, "warmups": n_warm,
                                "min_s": min(x["s"] for x in samples), "gb_per_s": info["bytes"] / med / 1e9,
                                "samples": samples})
                print(f"weight_sync:   {way:16s} {fmt_ms(med):>8s} ms", file=sys.stderr, flush=True)
            ray.get([bench.trainer.drop.remote(), bench.generator.drop.remote()])
    finally:
        if bench is not None:
            bench.close()
        ray.shutdown()
    total_s = time.monotonic() - t_start

    # -- the table
    header = ["size", "params", "tensors", "dtype", "MB", "way", "median ms", "min ms", "GB/s", "x fastest",
              "parts (median ms)"]
    rows, summary = [], {}
    for s in sizes:
        rs = [r for r in results if r["size"] == s]
        if not rs:
            continue
        fastest = min(r["median_s"] for r in rs)
        for r in rs:
            rows.append([s, f"{r['numel'] / 1e6:.1f}M", str(r["tensors"]), "/".join(r["dtypes"]),
                         f"{r['bytes'] / 1e6:.1f}", r["way"], fmt_ms(r["median_s"]), fmt_ms(r["min_s"]),
                         f"{r['gb_per_s']:.2f}", f"{r['median_s'] / fastest:.2f}",
                         " ".join(f"{k} {fmt_ms(v)}" for k, v in r["parts_s"].items() if k != "receiver_late")])
        ray_best = min((r for r in rs if r["way"].startswith("ray")), key=lambda r: r["median_s"], default=None)
        gloo_best = min((r for r in rs if r["way"].startswith("gloo")), key=lambda r: r["median_s"], default=None)
        if ray_best and gloo_best:
            summary[s] = {"object_store": ray_best["way"], "object_store_s": ray_best["median_s"],
                          "gloo": gloo_best["way"], "gloo_s": gloo_best["median_s"],
                          "ratio_store_over_gloo": ray_best["median_s"] / gloo_best["median_s"]}
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    for s, sm in summary.items():
        print(f"{s}: object store ({sm['object_store']}) / gloo ({sm['gloo']}) = "
              f"{sm['ratio_store_over_gloo']:.2f}")
    if no_pickle:
        print(f"ray pickle: not run at {', '.join(no_pickle)} (over --pickle-max-params {args.pickle_max_params:g}M)")
    for s, why in skipped.items():
        print(f"{s}: skipped: {why}")
    late = [f"{r['size']} {r['way']}" for r in results if r["parts_s"].get("receiver_late", 0) > 1e-3]
    if late:
        print(f"note: the generator reached the broadcast after the trainer started in: {', '.join(late)}")
    warm = sorted({r["warmups"] for r in results})
    print(f"median of {args.reps} publishes after {'/'.join(map(str, warm))} untimed ones (gloo 1, ray pickle 2, "
          f"the other object-store ways until its {store / GIB:.1f} GiB went through once, at most 20); {total_s:.0f} s in all")

    def phrase(s: str) -> str:
        sm = summary[s]
        won = ("object store", sm["object_store"], sm["object_store_s"])
        lost = ("gloo broadcast", sm["gloo"], sm["gloo_s"])
        if lost[2] < won[2]:
            won, lost = lost, won
        return (f"{won[0]} faster at {'the tiny size' if s == 'tiny' else s} "
                f"({fmt_ms(won[2])} ms vs {fmt_ms(lost[2])} ms, {won[1]} vs {lost[1]}, "
                f"{lost[2] / won[2]:.1f}x)")

    if args.json:
        out = {"args": vars(args), "dtype_synthetic": args.dtype, "object_store_bytes": store,
               "skipped": skipped, "ray_pickle_not_run": no_pickle, "summary": summary, "results": results, "total_s": total_s}
        from bench.machine import describe

        out["machine"] = describe()
        Path(args.json).write_text(json.dumps(out, indent=1))
    if not summary:
        print("object store vs gloo broadcast: nothing measured")
        return 1
    small = "tiny" if "tiny" in summary else next(iter(summary))
    large = "1.5b" if "1.5b" in summary else list(summary)[-1]
    parts = [phrase(small)] + ([phrase(large)] if large != small else [])
    print("object store vs gloo broadcast: " + " and ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
