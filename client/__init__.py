"""The Flower ClientApp of a gep-fed site."""
