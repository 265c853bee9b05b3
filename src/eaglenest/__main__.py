"""``python -m eaglenest``: the same as the ``eaglenest`` command."""

from eaglenest.cli import main

raise SystemExit(main())
