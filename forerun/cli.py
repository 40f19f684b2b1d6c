"""The ``forerun`` command: subcommands registered by the modules that implement them."""

from __future__ import annotations

import argparse
import logging
import sys

from forerun.bench.cli_bench import add_bench_parser
from forerun.cli_generate import add_chat_parser, add_generate_parser
from forerun.server.cli_serve import add_serve_parser
from forerun.server.disagg_proxy import add_disagg_proxy_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forerun", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_chat_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    add_disagg_proxy_parser(subparsers)
    parser.add_argument("--log-level", default="WARNING",
                        help="DEBUG, INFO, WARNING (default) or ERROR")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
