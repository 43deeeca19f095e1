"""CUDA kernel sources, shipped as package data for the run-time compiler."""
