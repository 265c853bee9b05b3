"""Writes the generated references (docs/params.md, docs/cli.md) and every figure drawn from a committed
measurement (README.md, docs/, docs/img/*.svg); ``--check`` only compares.

Run it from the repository root with the project's interpreter: ``python scripts/gen_reference.py [--check]``.
"""

from eaglenest.commands.reference import main

if __name__ == "__main__":
    raise SystemExit(main())
