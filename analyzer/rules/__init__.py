"""The built-in rules; importing this package registers them."""

from stacklens.analyzer.rules import alloc, backward, copies, gemm, gpu_launch, hotspots, layout, names, sync  # noqa: F401
