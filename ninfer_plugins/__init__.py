"""Built-in plugins. Each module registers through an entry point in group `ninfer`,
exactly as a third-party package would (see `[project.entry-points.ninfer]`)."""
