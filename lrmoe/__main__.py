"""Command-line entry point: ``python -m lrmoe <command>`` (also installed as the ``lrmoe`` console script)."""

from __future__ import annotations

import argparse
import sys

from lrmoe.demo.cli import add_demo_parser
from lrmoe.demo.study import add_study_parser

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand registers itself and sets ``handler``."""
    parser = argparse.ArgumentParser(prog="lrmoe", description="lrmoe command-line tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_demo_parser(subparsers)
    add_study_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
