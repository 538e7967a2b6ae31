"""The ``gep-fed`` command line: simulate, compare, report, calibrate, audit, ledger."""
