"""The host path: the NumPy emulator of the kernels (dense and packed batches) and the float64
reference attention."""
