"""Entry point: ``python -m trainer sim ...`` (cluster simulator) or ``python -m trainer torch ...``."""

from __future__ import annotations

import sys

USAGE = (
    "usage: python -m trainer {sim,torch} [options]   (--help after the back end for its options)"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    backend, rest = argv[0], argv[1:]
    if backend == "sim":
        from trainer.sim import main as sim_main

        return sim_main(rest)
    if backend == "torch":
        from trainer.torch_trainer import main as torch_main  # torch loads only here

        return torch_main(rest)
    print(f"trainer: unknown back end {backend!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
