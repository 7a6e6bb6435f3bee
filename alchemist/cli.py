"""The `alchemist` command line: serve, generate, keys, and the benchmarks (`alchemist bench ...`, bench/cli.py).

`serve`'s flags are the config tree's fields (alchemist/config/parse.py makes them with tyro); the other subcommands
register theirs in a small function. Heavy imports happen inside the handlers so that `alchemist --help` stays
instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from alchemist.bench import cli as bench_cli
from alchemist.config import Config, EngineConfig
from alchemist.config.parse import add_field_flags, parse_config, serve_flag_names


def _generate(args: argparse.Namespace) -> int:
    from alchemist.generate import generate_text

    for delta in generate_text(args):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="answer one chat prompt (greedy unless --temperature > 0)")
    add_field_flags(p, EngineConfig, "model", "dtype", "device")
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default=None, help="system message (default: the chat template's own)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_generate)


def _serve(args: argparse.Namespace) -> int:
    if args.serve.scale.replicas > 1:
        from alchemist.scale.serve import serve_replicas

        serve_replicas(args.serve)
        return 0
    from alchemist.runtime import build
    from alchemist.server.app import run_server

    run_server(build(args.serve, own_step_thread=False))  # the engine steps in the main thread: run_server's note
    return 0


def _register_serve(sub: argparse._SubParsersAction) -> None:
    # Its flags are parsed by the config tree's parser (main hands them over), --help included.
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)",
                       add_help=False)  # fmt: skip
    p.set_defaults(func=_serve, serve_base=Config)


def _keys_add(args: argparse.Namespace) -> int:
    from alchemist.server.auth import add_key

    key = add_key(args.file, args.name, args.admin, args.adapter)
    own = f" with adapter {args.adapter!r}" if args.adapter else ""
    print(f"{'admin' if args.admin else 'user'} key {args.name!r}{own} added to {args.file} (stored hashed; shown "
          "once):")  # fmt: skip
    print(key)
    return 0


def _register_keys(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="API keys of `serve --api-keys-file`")
    ksub = keys.add_subparsers(dest="keys", required=True)
    p = ksub.add_parser("add", help="make a new key, print it once, store its hash (SIGHUP or wait: serve reloads)")
    p.add_argument("name")
    p.add_argument("--admin", action="store_true", help="rollback, adapter management, /metrics and /docs")
    p.add_argument("--adapter", default=None, help="the key's own named adapter (--lora-modules or "
                   "/v1/load_lora_adapter): its requests for the base model are served by it")  # fmt: skip
    p.add_argument("--file", default="alchemist-data/api-keys.toml", help="the keys file")
    p.set_defaults(func=_keys_add)


# Subcommands register here; each adds its own parser.
REGISTRARS: list[Callable[[argparse._SubParsersAction], object]] = [_register_generate, _register_serve, _register_keys]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alchemist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRARS:
        register(sub)
    bench_cli.register(sub)
    return parser


def _serve_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` without the flags meant for the serve parser, and those flags: all of `serve`'s, and the serve flags
    among `bench online`'s, `bench paper`'s and `bench scale`'s (a serve flag and the values after it)."""
    if argv[:1] == ["serve"]:
        return ["serve"], argv[1:]
    if argv[:2] not in (["bench", "online"], ["bench", "paper"], ["bench", "scale"]):
        return argv, []
    names = serve_flag_names()
    rest, serve, i = argv[:2], [], 2
    while i < len(argv):
        taken = argv[i].split("=", 1)[0] in names
        (serve if taken else rest).append(argv[i])
        i += 1
        while taken and i < len(argv) and not argv[i].startswith("--"):
            serve.append(argv[i])
            i += 1
    return rest, serve


def main(argv: list[str] | None = None) -> int:
    own = argv is None
    argv, serve_argv = _serve_flags(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    if hasattr(args, "serve_base"):
        prog = "alchemist " + " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
        try:
            args.serve = parse_config(serve_argv, args.serve_base(), prog=prog)
        except (FileNotFoundError, ValueError) as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
    # Imported after parsing: the engine package brings torch and transformers (~4 s), which --help and argument
    # errors never need.
    from alchemist.host_memory import keep_freed_memory, use_allocator

    try:
        if args.func is _serve and own:  # the process's own command line: it may be run again in place
            use_allocator(args.serve.server.allocator)
        keep_freed_memory()  # this process owns the allocator: reuse freed buffers (host_memory.py)
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"alchemist: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
