"""The ``eaglenest`` commands: cli, doctor, inspect, import, report, serve. No stage depends on them."""
