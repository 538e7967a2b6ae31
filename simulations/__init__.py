"""Runnable experiments on one machine (Flower Simulation Engine)."""
