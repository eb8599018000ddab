"""Kernels in the core: the reference ops (`reference.TorchOps`) and the per-op
composition of kernel backends (`compose`)."""
