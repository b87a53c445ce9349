"""``rlcore serve``: a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Thin: checks the options and the model folder (one line and exit code 2 when they are wrong, before
anything loads), opens the listening socket (a port in use is a one-line error too), loads the model
into the params' rollout engine (:func:`rlcore.serve.server.load_server`) and runs uvicorn until Ctrl-C.
The API, its batching and its errors: :mod:`rlcore.serve`.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from rlcore.commands.common import add_config_options, config_from, positive_int
from rlcore.errors import ConfigError, InputNotFound, UserError
from rlcore.kernels import activate

HELP = "serve a model over an OpenAI-compatible HTTP API (completions, chat completions), batching requests"
EXAMPLE = "rlcore serve --model models/ppo/r1 --port 8000   |   rlcore serve --model tiny --no-batching"


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="local Hugging Face model folder (e.g. models/ppo/r1), or 'tiny' for the built-in model "
                        "(default: params model.path)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (default: 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: --model as given)")
    p.add_argument("--max-batch-size", type=positive_int, default=64, metavar="ROWS",
                   help="completions one engine call generates at most (default: 64)")
    p.add_argument("--batch-wait-ms", type=_non_negative, default=5.0, metavar="MS",
                   help="how long a request that finds the engine idle waits for others to join its call "
                        "(default: 5)")
    p.add_argument("--no-batching", dest="batching", action="store_false",
                   help="run every request as its own engine call (for comparison)")
    p.add_argument("--max-n", type=positive_int, default=16, help="most completions per prompt (n) (default: 16)")
    p.add_argument("--max-tokens", type=positive_int, default=1024, metavar="TOKENS",
                   help="most tokens one completion generates; a request asking for more gets this many, as vLLM's "
                        "server-wide max_tokens (default: 1024)")
    p.add_argument("--max-queue", type=positive_int, default=128, metavar="REQUESTS",
                   help="most requests waiting for the engine; one more gets 503 with Retry-After (default: 128)")
    p.add_argument("--request-timeout", type=_positive_seconds, default=600.0, metavar="SECONDS",
                   help="a request not answered within this long gets 504 (default: 600)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, metavar="BYTES",
                   help="largest request body; a larger one gets 413 before it is read (default: 1048576)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (default: auto = cuda when available, else cpu)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads for the model (default: torch's choice, one per core; on a machine with few "
                        "cores, fewer threads leave the HTTP side a core: bench/serve_load.py)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                   help="uvicorn's log level (default: info, one line per request)")
    add_config_options(p)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it), or a one-line error."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise UserError(f"--host {host} --port {port}: cannot listen there: {err.strerror or err}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    model = args.model or cfg.model.path
    if model != "tiny" and not (Path(model) / "config.json").is_file() \
            and not (Path(model) / "adapter_config.json").is_file():
        what = "--model" if args.model else "params model.path"
        raise InputNotFound(f"{what} {model!r}: expected a local Hugging Face model folder with config.json (or a LoRA "
                            "adapter folder)")
    if args.max_n > args.max_batch_size:
        raise ConfigError(f"--max-n {args.max_n} is more than --max-batch-size {args.max_batch_size}: "
                          f"one request's completions must fit one engine call")
    sock = listen(args.host, args.port)
    try:
        import torch
        import uvicorn

        from rlcore.engine.model import resolve_model_path
        from rlcore.serve.app import create_app
        from rlcore.serve.server import ServeOptions, load_server

        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here (use --device cpu or auto)")
        on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda" if on_gpu else "cpu")
        activate(args.threads)  # the engine computes in this process
        folder = resolve_model_path(model, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.seed)
        if model == "tiny":
            print(f"rlcore serve: the built-in tiny model, untrained (params model.tiny, seed): {folder}")
        options = ServeOptions(served_model_name=args.served_model_name or model, max_batch_size=args.max_batch_size,
                               batch_wait_ms=args.batch_wait_ms, batching=args.batching, max_n=args.max_n,
                               max_tokens=args.max_tokens, max_queue=args.max_queue,
                               request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes)
        server = load_server(folder, cfg, options, device)
        batching = f"batching up to {args.max_batch_size} rows" if args.batching else "no batching"
        print(f"rlcore serve: {options.served_model_name} on {device} (engine {cfg.rollout.engine}, {batching}) "
              f"at http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
        uvicorn.Server(uvicorn.Config(create_app(server), log_level=args.log_level)).run(sockets=[sock])
    finally:
        sock.close()
    return 0
