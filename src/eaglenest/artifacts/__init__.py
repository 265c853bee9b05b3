"""What stages hand each other: one module per file format a stage writes and a later stage reads,
each with its write, read and validate. Artifacts import only the ground (:mod:`eaglenest.core`)."""
