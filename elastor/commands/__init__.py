"""One module per subcommand; each defines `register(subparsers)` and stays a thin dispatcher."""

import argparse


def subcommand(subparsers: argparse._SubParsersAction, name: str, summary: str, example: str):
    """A subparser whose --help ends with a real example."""
    return subparsers.add_parser(
        name,
        help=summary,
        description=summary,
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
