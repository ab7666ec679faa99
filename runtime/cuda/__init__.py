"""The only package that imports `cuda.bindings`: checked driver calls, the cubin/manifest
loader, the kernel launcher, device arenas, streams, events and CUDA graphs, plus a null device
so CPU tests exercise this layer without a GPU."""
