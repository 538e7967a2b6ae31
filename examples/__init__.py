"""Worked examples of user code that runs on gep-fed (not installed with the library)."""
