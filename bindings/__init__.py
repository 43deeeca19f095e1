"""PyTorch adapter."""
