"""``python -m eaglenest``: the same as the ``eaglenest`` command."""

from eaglenest.commands.cli import main

raise SystemExit(main())
