"""Command-line entry points: `ninfer` and `ninfer-serve`."""
