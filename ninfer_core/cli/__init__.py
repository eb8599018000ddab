"""Command-line entry points: `ninfer` and `ninfer-serve`.

Both import this package first, so the CPU runtime's environment is set here, before any
module imports torch (OpenMP and oneDNN read it once, when they load).
"""

from ninfer_core.device import configure_cpu_runtime

configure_cpu_runtime()
