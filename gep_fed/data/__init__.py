"""Data and tasks: data sets and their loaders, site partitions, models, the built-in tasks."""
