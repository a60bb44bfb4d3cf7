"""User tools, run from the repository root as modules: ``python -m scripts.<name>`` (see README.md)."""
