"""The Flower ServerApp of a gep-fed federation."""
